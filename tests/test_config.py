"""Configuration: precedence of arguments > environment > TOML file > defaults,
per-backend option tables, and errors that name the field and its source."""

import re

import pytest

from kvt import ConfigError
from kvt.config import Config, load_config

FILE = """\
backend = "fromfile"
name = "prefill-0"
listen_port = 7000
transfer_timeout = 12
options = { shared = "file", layer = "options" }

[backends.fromfile]
layer = "backends.fromfile"
only_fromfile = true

[backends.fromenv]
layer = "backends.fromenv"
"""


def _re(path):
    return re.escape(str(path))


@pytest.fixture
def toml(tmp_path):
    """Write a TOML file, return its path."""
    def write(text=FILE, name="kvt.toml"):
        path = tmp_path / name
        path.write_text(text)
        return path
    return write


def test_defaults():
    c = load_config(env={})
    assert c == Config(backend="host", options={"timeout": 30.0}, name=None, listen_host="127.0.0.1",
                       listen_port=0, handshake_timeout=5.0, transfer_timeout=30.0)


def test_where_the_backend_came_from_is_kept_beside_the_fields():
    a, b = load_config(env={"KVT_BACKEND": "host"}), load_config(backend="host", env={})
    assert (a.backend_source, b.backend_source) == ("environment variable KVT_BACKEND", "load_config() arguments")
    assert a == b and a.shown() == b.shown()  # the same settings: equal
    with pytest.raises(AttributeError, match="no field 'transfer_timout'"):
        a.transfer_timout = 3  # a misspelt field is still an error, not a new attribute


def test_file_from_kvt_config(toml):
    c = load_config(env={"KVT_CONFIG": str(toml())})
    assert (c.backend, c.name, c.listen_port, c.transfer_timeout) == ("fromfile", "prefill-0", 7000, 12.0)
    # file [options] < [backends.<chosen>]; timeout seeded from transfer_timeout
    assert c.options == {"shared": "file", "layer": "backends.fromfile", "only_fromfile": True, "timeout": 12.0}


def test_env_backend_beats_file_and_picks_its_table(toml):
    c = load_config(env={"KVT_CONFIG": str(toml()), "KVT_BACKEND": "fromenv"})
    assert c.backend == "fromenv"
    assert c.options == {"shared": "file", "layer": "backends.fromenv", "timeout": 12.0}


def test_explicit_arguments_beat_environment_and_file(toml):
    c = load_config("explicit", {"layer": "explicit", "timeout": 2}, env={"KVT_CONFIG": str(toml()),
                    "KVT_BACKEND": "fromenv"}, listen_port=7001, name=None)
    assert (c.backend, c.listen_port, c.name) == ("explicit", 7001, "prefill-0")  # name=None: not given
    assert c.options == {"shared": "file", "layer": "explicit", "timeout": 2}


def test_explicit_options_merge_over_the_chosen_backend_table(toml):
    c = load_config(options={"layer": "explicit"}, env={"KVT_CONFIG": str(toml())})
    assert c.options == {"shared": "file", "layer": "explicit", "only_fromfile": True, "timeout": 12.0}


def test_explicit_path_beats_kvt_config(toml):
    other = toml('backend = "other"\n', name="other.toml")
    c = load_config(path=other, env={"KVT_CONFIG": str(toml())})
    assert c.backend == "other" and c.listen_port == 0


def test_empty_environment_variables_count_as_unset():
    assert load_config(env={"KVT_BACKEND": "", "KVT_CONFIG": ""}).backend == "host"


def test_direct_construction_seeds_timeout_option():
    assert Config(transfer_timeout=4).options == {"timeout": 4.0}
    assert Config(options={"timeout": 1.5}).options == {"timeout": 1.5}


@pytest.mark.parametrize("field, value, why", [
    ("listen_port", 70000, "Expected `int` <= 65535"),
    ("listen_port", -1, "Expected `int` >= 0"),
    ("listen_port", '"80"', "Expected `int`, got `str`"),
    ("listen_port", "true", "Expected `int`, got `bool`"),
    ("handshake_timeout", 0, "Expected `float` > 0.0"),
    ("transfer_timeout", -1.5, "Expected `float` > 0.0"),
    ("backend", '""', "Expected `str` of length >= 1"),
    ("name", 5, "Expected `str | null`, got `int`"),
    ("listen_host", "[]", "Expected `str`, got `array`"),
    ("options", "3", "Expected `object`, got `int`"),
])
def test_bad_file_value_names_field_and_file(toml, field, value, why):
    path = toml(f"{field} = {value}\n")
    with pytest.raises(ConfigError) as e:
        load_config(env={"KVT_CONFIG": str(path)})
    msg = str(e.value)
    assert f"invalid {field} = " in msg and f"from {path} (from KVT_CONFIG)" in msg and why in msg
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("kwargs, field", [
    ({"listen_port": 65536}, "listen_port"),
    ({"handshake_timeout": "5"}, "handshake_timeout"),
    ({"transfer_timeout": 0}, "transfer_timeout"),
    ({"backend": ""}, "backend"),
    ({"name": ""}, "name"),
])
def test_bad_argument_names_field(kwargs, field):
    with pytest.raises(ConfigError, match=rf"invalid {field} = .* from load_config\(\) arguments"):
        load_config(env={}, **kwargs)


def test_bad_timeout_option_names_it_and_its_table(toml):
    path = toml('[backends.host]\ntimeout = 0\n')
    with pytest.raises(ConfigError, match=rf"{_re(path)} \[backends.host\]: options.timeout must be a positive"):
        load_config(path=path, env={})
    with pytest.raises(ConfigError, match=r"load_config\(options=...\): options.timeout must be a positive"):
        load_config(options={"timeout": "soon"}, env={})


def test_bad_environment_backend_names_the_variable():
    with pytest.raises(ConfigError, match="invalid backend = .* from environment variable KVT_BACKEND"):
        load_config(env={"KVT_BACKEND": 7})  # only a non-string reaches this; os.environ holds str


def test_unknown_file_key_is_named_with_a_suggestion(toml):
    path = toml("listen_prot = 1\n")
    with pytest.raises(ConfigError, match=rf"unknown configuration key 'listen_prot' in {_re(path)} "
                                          r"\(did you mean 'listen_port'\?\)"):
        load_config(path=path, env={})


def test_unknown_argument_is_named():
    with pytest.raises(ConfigError, match="unknown configuration key 'bogus' in load_config"):
        load_config(env={}, bogus=1)


@pytest.mark.parametrize("text, what", [
    ("backends = 3\n", "'backends' in .* must be a table of per-backend option tables"),
    ("[backends]\nhost = 1\n", "'backends.host' in .* must be a table of options"),
])
def test_malformed_backend_tables(toml, text, what):
    with pytest.raises(ConfigError, match=what):
        load_config(path=toml(text), env={})


def test_invalid_toml_names_the_file(toml):
    path = toml("backend = \n")
    with pytest.raises(ConfigError, match=rf"file {_re(path)} \(from KVT_CONFIG\) is not valid TOML"):
        load_config(env={"KVT_CONFIG": str(path)})


def test_missing_file_names_the_file(tmp_path):
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match=rf"cannot read config file {_re(path)} \(from KVT_CONFIG\): No such"):
        load_config(env={"KVT_CONFIG": str(path)})


# -- hostile files and variables (audit) -------------------------------------------------------------

def test_file_that_is_not_utf8_names_the_file(toml):
    path = toml()
    path.write_bytes(b'backend = "host"\nname = "\xff\xfe"\n')
    with pytest.raises(ConfigError, match=rf"config file {_re(path)} is not UTF-8 text"):
        load_config(path=path, env={})


def test_deeply_nested_file_is_a_config_error(toml):
    path = toml("x = " + "[" * 100_000 + "]" * 100_000 + "\n")  # before: RecursionError escaped
    with pytest.raises(ConfigError, match=rf"config file {_re(path)} is not valid TOML: .*nest"):
        load_config(path=path, env={})


def _load_in_child(tmp_path, **env):
    """load_config() in a child with 2 GiB of address space (so an unbounded read fails fast instead
    of eating the machine) and a 30 s limit (a blocking open is a hang, not a test run that never ends)."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
            "from kvt.config import load_config\nfrom kvt import KvtError\n"
            "try:\n    load_config()\nexcept KvtError as e:\n    print(type(e).__name__, e)\n")
    import os
    import subprocess
    import sys
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                              cwd=tmp_path, env={**os.environ, **env})
    except subprocess.TimeoutExpired:
        pytest.fail(f"load_config() with {env} blocked for 30 s")


@pytest.mark.parametrize("var", ["KVT_CONFIG", "KVT_AUTH_KEY_FILE"])
def test_named_pipe_is_refused_not_waited_on(tmp_path, var):
    import os
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # no writer: open() for reading would block for ever
    r = _load_in_child(tmp_path, **{var: str(fifo)})
    assert r.returncode == 0 and r.stdout.startswith("ConfigError ") and "not a regular file" in r.stdout, r
    assert str(fifo) in r.stdout


def test_endless_config_file_is_refused(tmp_path):
    r = _load_in_child(tmp_path, KVT_CONFIG="/dev/zero")  # before: read until memory ran out
    assert r.returncode == 0 and r.stdout.startswith("ConfigError ") and "/dev/zero" in r.stdout, r
    assert "longer than" in r.stdout


def test_dev_null_still_reads_as_an_empty_file():
    assert load_config(env={"KVT_CONFIG": "/dev/null"}).backend == "host"


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), (" Yes ", True), ("on", True),
                                       ("0", False), ("false", False), ("no", False), ("OFF", False)])
def test_integrity_variable_values(value, on):
    assert load_config(env={"KVT_INTEGRITY": value}).integrity is on


@pytest.mark.parametrize("value", ["maybe", "tru", "2", "enable"])
def test_unrecognised_integrity_variable_is_refused(value):
    # before: anything but 1/true/yes/on silently meant off -- a typo disabled the checks
    with pytest.raises(ConfigError, match=rf"KVT_INTEGRITY.*{value!r}.*1, true, yes, on.*0, false, no, off"):
        load_config(env={"KVT_INTEGRITY": value})


def test_a_key_read_from_its_file_survives_copies_and_is_never_shown(tmp_path):
    # before: the copy a child process unpickles (or msgspec rebuilds) had auth_key and
    # auth_key_file both set, and failed with "set auth_key or auth_key_file, not both"
    import pickle

    import msgspec

    key = "file-key-" + "z" * 32
    (tmp_path / "key").write_text(key + "\n")
    cfg = Config(auth_key_file=str(tmp_path / "key"))
    assert cfg.auth_key == key and cfg.auth_key_file is None
    assert pickle.loads(pickle.dumps(cfg)).auth_key == key
    assert msgspec.convert(msgspec.to_builtins(cfg), Config).auth_key == key
    assert cfg.shown()["auth_key"] == "***" and key not in repr(cfg) + repr(cfg.shown())


# -- Config(...) built directly is checked like load_config's values, with ConfigError --

@pytest.mark.parametrize("kwargs, says", [
    ({"auth_key": "a"}, "auth_key must be at least"),
    ({"options": {"timeout": "x"}}, "options.timeout must be a positive number"),
    ({"options": {"auth_key": "k" * 40}}, "not a backend option"),
    ({"discovery": "http://x"}, "unknown scheme 'http'"),
    ({"auth_key_file": "/nonexistent/kvt-key"}, "cannot read auth_key_file"),
    ({"listen_port": "x"}, "invalid listen_port = 'x' from Config(...): Expected `int`, got `str`"),
    ({"listen_port": 65536}, "invalid listen_port = 65536"),
    ({"handshake_timeout": -1}, "invalid handshake_timeout = -1"),
    ({"transfer_timeout": float("inf")}, "invalid transfer_timeout"),
    ({"backend": 5}, "invalid backend = 5"),
    ({"integrity": "yes"}, "invalid integrity = 'yes'"),
    ({"options": [1, 2]}, "invalid options = [1, 2]"),
])
def test_config_built_directly_raises_config_error(kwargs, says):
    with pytest.raises(ConfigError) as e:
        Config(**kwargs)
    assert says in str(e.value)


def test_config_built_directly_hides_a_bad_key():
    with pytest.raises(ConfigError) as e:
        Config(auth_key="short-secret")
    assert "short-secret" not in str(e.value)


def test_both_key_and_key_file_built_directly_is_a_config_error(tmp_path):
    (tmp_path / "key").write_text("k" * 40)
    with pytest.raises(ConfigError, match="not both"):
        Config(auth_key="k" * 40, auth_key_file=str(tmp_path / "key"))


@pytest.mark.parametrize("path", [5, b"/etc/hostname", 1.5])
def test_a_path_that_is_not_a_path_is_a_config_error(path):
    with pytest.raises(ConfigError, match="must be a str or os.PathLike"):
        load_config(path=path, env={})


def test_agent_refuses_a_config_that_is_not_a_config():
    from kvt import Agent

    with pytest.raises(ConfigError, match=r"kvt\.load_config"):
        Agent(config={"backend": "host"})


def test_an_env_that_is_not_a_mapping_is_a_config_error():
    with pytest.raises(ConfigError, match="env must be a mapping"):
        load_config(env=None)
