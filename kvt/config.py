"""Configuration: which backend, its options, and the agent's network settings.

Sources, highest precedence first::

    explicit arguments      load_config(backend=..., options=..., listen_port=...)
    environment             KVT_BACKEND=<name>
    TOML file               path=... argument, else KVT_CONFIG=<path>
    defaults                the field defaults of ``Config``

The TOML file's top-level keys are ``Config`` fields, plus per-backend option
tables ``[backends.NAME]`` applied when NAME is the chosen backend.  Options
merge key by key: file ``options`` < file ``[backends.NAME]`` < explicit
``options``.  Every value is validated with msgspec; a bad one raises
``ConfigError`` naming the field and where it came from.  See
docs/configuration.md.
"""

from __future__ import annotations

import contextvars
import difflib
import os
import stat
from pathlib import Path
from typing import Annotated, Any, Mapping

import msgspec

from .auth import MIN_KEY_CHARS
from .errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["Config", "load_config", "ENV_BACKEND", "ENV_CONFIG", "ENV_DISCOVERY", "ENV_INTEGRITY",
           "ENV_AUTH_KEY", "ENV_AUTH_KEY_FILE"]

ENV_BACKEND = "KVT_BACKEND"
ENV_CONFIG = "KVT_CONFIG"
ENV_DISCOVERY = "KVT_DISCOVERY"
ENV_INTEGRITY = "KVT_INTEGRITY"
ENV_AUTH_KEY = "KVT_AUTH_KEY"
ENV_AUTH_KEY_FILE = "KVT_AUTH_KEY_FILE"
_SECRET_FIELDS = ("auth_key",)  # never shown: not in repr, not in error messages

#: the longest timeout accepted (~31 years): inf or 1e300 seconds overflow the waits they reach
#: (``threading`` and ZMQ timeouts), which raised OverflowError instead of waiting
MAX_SECONDS = 1e9
_Seconds = Annotated[float, msgspec.Meta(gt=0, le=MAX_SECONDS)]
_Text = Annotated[str, msgspec.Meta(min_length=1)]


def check_timeout(value: Any, name: str = "timeout") -> float:
    """``value`` if it is a positive number of seconds, at most
    ``MAX_SECONDS``; ``ConfigError`` naming ``name`` otherwise (a NaN, a
    negative or an infinite timeout would break every wait built on it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_SECONDS:
        raise ConfigError(f"{name} must be a positive number of seconds, at most {MAX_SECONDS:g}, got {value!r}")
    return value


class Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, dict=True):
    """A validated kvt configuration."""

    #: entry-point name of the backend (``kvt backends`` lists them)
    backend: _Text = "host"
    #: the backend's own options; ``timeout`` defaults to ``transfer_timeout``
    options: dict[str, Any] = {}
    #: agent name; ``None`` lets the agent pick a unique one
    name: _Text | None = None
    #: address the handshake listener binds to
    listen_host: _Text = "127.0.0.1"
    #: port the handshake listener binds to; 0 = any free port
    listen_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    #: seconds to wait for a peer's metadata
    handshake_timeout: _Seconds = 5.0
    #: seconds before an unresponsive peer turns a transfer to ERR
    transfer_timeout: _Seconds = 30.0
    #: where agents publish and resolve each other by name (``etcd://host:port``,
    #: ``tcpstore://host:port``); ``None``: connect by endpoint only (kvt/discovery.py)
    discovery: _Text | None = None
    #: verify every waited block transfer end to end with checksums (kvt/integrity.py)
    integrity: bool = False
    #: shared secret every peer must prove (kvt/auth.py); ``None``: any peer that can connect is served
    auth_key: _Text | None = None
    #: a file holding ``auth_key`` (read at load time, surrounding whitespace stripped)
    auth_key_file: _Text | None = None
    #: set by ``load_config``: the keys of ``options`` that came from the file's shared
    #: ``[options]`` table, which a backend that does not read them ignores (any other
    #: key the backend does not know is a ``ConfigError``)
    shared_options: frozenset[str] = frozenset()

    def __setattr__(self, name: str, value: Any) -> None:
        # the __dict__ (dict=True) is for backend_source alone: a misspelt field stays an error
        if name not in self.__struct_fields__ and name != "_backend_source":
            raise AttributeError(f"Config has no field {name!r}; its fields: {', '.join(_FIELDS)}")
        super().__setattr__(name, value)

    @property
    def backend_source(self) -> str:
        """Where ``backend`` came from, for messages about it: kept beside the
        fields (set by ``load_config``), so it is no part of equality."""
        return self.__dict__.get("_backend_source", "Config(...)")

    def __post_init__(self) -> None:
        # ``Config(...)`` does not check field types (``msgspec.convert`` does): check each the way
        # load_config does, unless this instance is being built by one of those conversions
        if not _converting.get():
            for field in _FIELDS:
                _check(field, getattr(self, field), "Config(...)")
        if self.auth_key_file is not None:
            if self.auth_key is not None:
                raise ConfigError("set auth_key or auth_key_file, not both")
            # read once: the key is what the config holds from now on, so a copy rebuilt from its
            # fields (pickled to a child process, converted) has auth_key alone and reads nothing
            self.auth_key, self.auth_key_file = _read_key(self.auth_key_file), None
        if self.auth_key is not None and len(self.auth_key) < MIN_KEY_CHARS:
            raise ConfigError(f"auth_key must be at least {MIN_KEY_CHARS} characters; generate one with "
                             "python -c 'import secrets; print(secrets.token_hex(32))'")
        if self.discovery is not None:  # a typo in the URL shows now, not at the first connect by name
            from .discovery import parse_url

            try:
                parse_url(self.discovery)
            except ConfigError as e:
                raise ConfigError(str(e)) from None
        if "auth_key" in self.options:
            raise ConfigError("auth_key is a configuration field, not a backend option: set auth_key in "
                             f"the config file or {ENV_AUTH_KEY}")
        timeout = check_timeout(self.options.get("timeout", self.transfer_timeout), "options.timeout")
        self.options = {**self.options, "timeout": timeout}

    def __repr__(self) -> str:
        shown = ", ".join(f"{f}={'***' if f in _SECRET_FIELDS and getattr(self, f) is not None else repr(getattr(self, f))}"
                          for f in self.__struct_fields__)
        return f"Config({shown})"

    __rich_repr__ = None

    def shown(self) -> dict[str, Any]:
        """The fields as plain data for reports and ``--json`` output, secrets masked."""
        return msgspec.to_builtins({f: "***" if f in _SECRET_FIELDS and v is not None else v
                                    for f, v in msgspec.structs.asdict(self).items() if f != "shared_options"})


MAX_KEY_FILE_BYTES = 65536  # a key file is a line of text: /dev/zero or a huge file must not be read whole
MAX_CONFIG_FILE_BYTES = 1 << 20  # a TOML file of settings; more is a mistake (or /dev/zero)


def _read_bounded(path: str | os.PathLike, limit: int) -> bytes:
    """At most ``limit`` bytes of the file at ``path``; ``OSError`` or ``ValueError`` saying why not.

    Opened without blocking: a named pipe (or socket) nobody writes to would
    block ``open`` for ever, so only regular files and character devices
    (``/dev/null``) are read, and more than ``limit`` bytes is refused."""
    fd = os.open(Path(path).expanduser(), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ValueError("it is a directory")
        if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
            raise ValueError("not a regular file (a named pipe or socket would block); give a file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(raw) > limit:
        raise ValueError(f"longer than {limit} bytes")
    return raw


def _read_key(path: str) -> str:
    try:
        return _read_bounded(path, MAX_KEY_FILE_BYTES).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"cannot read auth_key_file {path}: {getattr(e, 'strerror', None) or e}") from None


_FIELDS = tuple(f for f in Config.__struct_fields__ if f != "shared_options")  # settable ones
#: set while ``msgspec.convert`` builds a Config from values it type-checks itself
_converting: contextvars.ContextVar[bool] = contextvars.ContextVar("kvt_config_converting", default=False)


def _unknown(key: str, source: str, valid: tuple[str, ...]) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1)
    maybe = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown configuration key {key!r} in {source}{maybe}; valid keys: {', '.join(valid)}")


def _read_toml(path: str | os.PathLike, source: str) -> dict[str, Any]:
    try:
        text = _read_bounded(path, MAX_CONFIG_FILE_BYTES).decode("utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {source}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {source} is not UTF-8 text: {e}") from None
    except ValueError as e:  # not a regular file, too long, or a NUL in the path
        raise ConfigError(f"cannot read config file {source}: {e}") from None
    except TypeError:  # pathlib takes str or os.PathLike (of str) only
        raise ConfigError(f"config file path {source} must be a str or os.PathLike, "
                          f"got {type(path).__name__}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {source} is not valid TOML: {e}") from e
    except RecursionError:  # tomllib parses nested arrays and tables recursively
        raise ConfigError(f"config file {source} is not valid TOML: its values nest too deeply") from None


def _split_file(data: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate a TOML document into Config fields and ``[backends.*]`` tables."""
    tables = data.pop("backends", {})
    for key in data:
        if key not in _FIELDS:
            raise _unknown(key, source, (*_FIELDS, "backends"))
    if not isinstance(tables, dict):
        raise ConfigError(f"'backends' in {source} must be a table of per-backend option tables "
                          f"([backends.NAME]), got {type(tables).__name__}")
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ConfigError(f"'backends.{name}' in {source} must be a table of options, "
                              f"got {type(table).__name__}")
    return data, tables


def _check(field: str, value: Any, source: str) -> None:
    """Validate one field alone so that the error names it and its source."""
    token = _converting.set(True)
    try:
        msgspec.convert({field: value}, Config)
        if isinstance(value, str):
            # non-UTF-8 bytes in an environment variable arrive as lone surrogates: refused here, not
            # as a UnicodeEncodeError from deep in a handshake (or in each process `kvt demo` starts)
            value.encode("utf-8")
    except (msgspec.ValidationError, UnicodeEncodeError) as e:
        why = str(e).split(" - at `$", 1)[0] if isinstance(e, msgspec.ValidationError) else \
            f"not UTF-8 text (character {e.start} is not encodable); give UTF-8 text"
        if isinstance(value, dict) and _SECRET_FIELDS[0] in value:  # a key misplaced among backend options
            value = {**value, _SECRET_FIELDS[0]: "***"}
        shown = "***" if field in _SECRET_FIELDS else repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        # (a UnicodeEncodeError holds the whole text, which may be the secret key: not chained)
        raise ConfigError(f"invalid {field} = {shown} from {source}: {why}") \
            from (e if isinstance(e, msgspec.ValidationError) else None)
    finally:
        _converting.reset(token)


_DEFAULTS = Config()


_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(var: str, raw: Any) -> Any:
    """An on/off environment variable; anything else is refused (a typo must not turn a check off)."""
    if not isinstance(raw, str):
        return raw  # only a test's env mapping holds non-strings; validation names it
    word = raw.strip().lower()
    if word in _ON + _OFF:
        return word in _ON
    raise ConfigError(f"environment variable {var}={raw!r} is neither on ({', '.join(_ON)}) "
                      f"nor off ({', '.join(_OFF)})")


def _as_dict(options: Any) -> Any:
    if options is None:
        return {}
    return dict(options) if isinstance(options, Mapping) else options  # non-mappings fail validation


_ARGS = "load_config() arguments"


def load_config(backend: str | None = None, options: Mapping[str, Any] | None = None, *,
                path: str | os.PathLike | None = None, env: Mapping[str, str] = os.environ,
                shared: bool = False, origin: str = _ARGS, **overrides: Any) -> Config:
    """Build a ``Config`` from explicit arguments, the environment and a TOML file.

    ``overrides`` are other ``Config`` fields (``name``, ``listen_port``...);
    an argument that is ``None`` counts as not given.  ``shared``: the
    explicit ``options`` serve several backends, so (like the file's
    ``[options]``) a backend ignores those it does not read.  ``env``
    replaces ``os.environ`` (tests).  ``origin``: where the explicit
    arguments came from, for messages (a command line: its flags).  Raises
    ``ConfigError`` naming the offending field or key and its source.
    """
    if not isinstance(env, Mapping):
        raise ConfigError(f"env must be a mapping of environment variables, got {type(env).__name__}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    file_options: dict[str, Any] = {}
    tables: dict[str, Any] = {}

    if path is None and env.get(ENV_CONFIG):
        path, file_source = env[ENV_CONFIG], f"{env[ENV_CONFIG]} (from {ENV_CONFIG})"
    else:
        file_source = str(path)
    if path is not None:
        data, tables = _split_file(_read_toml(path, file_source), file_source)
        if isinstance(data.get("options"), dict):
            file_options = data.pop("options")
        values.update(data)
        sources.update(dict.fromkeys(data, file_source))

    if env.get(ENV_BACKEND):
        values["backend"], sources["backend"] = env[ENV_BACKEND], f"environment variable {ENV_BACKEND}"
    if env.get(ENV_INTEGRITY):
        values["integrity"] = _flag(ENV_INTEGRITY, env[ENV_INTEGRITY])
        sources["integrity"] = f"environment variable {ENV_INTEGRITY}"
    if env.get(ENV_AUTH_KEY) or env.get(ENV_AUTH_KEY_FILE):  # the environment replaces the file's key
        values.pop("auth_key", None), values.pop("auth_key_file", None)
        for var, field in ((ENV_AUTH_KEY, "auth_key"), (ENV_AUTH_KEY_FILE, "auth_key_file")):
            if env.get(var):
                values[field], sources[field] = env[var], f"environment variable {var}"
    if env.get(ENV_DISCOVERY):
        values["discovery"], sources["discovery"] = env[ENV_DISCOVERY], f"environment variable {ENV_DISCOVERY}"

    explicit = {k: v for k, v in {"backend": backend, **overrides}.items() if v is not None}
    for key in explicit:
        if key not in _FIELDS:
            raise _unknown(key, origin, _FIELDS)
    values.update(explicit)
    sources.update(dict.fromkeys(explicit, origin))

    for field, value in values.items():
        _check(field, value, sources[field])

    # options merge key by key: file [options] < file [backends.<chosen>] < explicit
    chosen = values.get("backend", _DEFAULTS.backend)
    merged: dict[str, Any] = {}
    for layer, source in ((file_options, f"{file_source} [options]"),
                          (tables.get(chosen, {}), f"{file_source} [backends.{chosen}]"),
                          (_as_dict(options), "load_config(options=...)" if origin == _ARGS else origin)):
        _check("options", layer, source)
        merged.update(layer)
    values["options"] = merged
    explicit_options = _as_dict(options)
    values["shared_options"] = (frozenset(explicit_options) if shared else frozenset()).union(
        frozenset(file_options).difference(tables.get(chosen, {}), explicit_options))
    token = _converting.set(True)  # every field was checked above
    try:
        config = msgspec.convert(values, Config)
    except msgspec.ValidationError as e:  # kept as a backstop
        raise ConfigError(f"invalid configuration: {e}") from e
    finally:
        _converting.reset(token)
    config._backend_source = sources.get("backend", "the default")
    return config
