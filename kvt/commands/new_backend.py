"""``kvt new-backend NAME [DIR]``: write an installable skeleton of a backend
plugin -- pyproject with the entry point, a backend class whose every verb
raises ``UnsupportedOperation`` saying what to implement, and a one-class
conformance test module -- so that ``pip install -e DIR && kvt conformance
NAME`` runs at once and its failures say what to build next."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from .. import registry
from ..errors import InvalidArgument

__all__ = ["register", "run", "write_skeleton"]

_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,39}$")

#: verb -> (signature, what to implement); the stubs' messages come from here
VERBS = {
    "register": ("self, mem: Descs) -> RegHandle",
                 "make the memory reachable by peers (pin it, register it with your library) and return a handle"),
    "deregister": ("self, handle: RegHandle) -> None",
                   "forget a registration; from then on peers' requests for that memory are refused"),
    "local_metadata": ("self) -> bytes",
                       "return the bytes a peer needs to reach this agent (a kvt.wire.Message subclass, encoded)"),
    "add_remote": ("self, metadata: bytes) -> str",
                   "decode a peer's metadata (WireError on bad bytes) and return the peer's agent name"),
    "remove_remote": ("self, peer: str) -> None",
                      "forget a peer; its in-flight transfers end in ERR"),
    "prep": ("self, peer: str | None, descs: Descs) -> PrepHandle",
             "check the rows lie in registered memory (ours for peer=None, else the peer's) and remember them"),
    "transfer": ("self, op: Op, local_prep: PrepHandle, local_idx: Any, remote_prep: PrepHandle, "
                 "remote_idx: Any, notif: bytes | None = None) -> XferHandle",
                 "post the READ or WRITE without blocking (pair rows with self._pair) and return a handle"),
    "check_state": ("self, handle: XferHandle) -> XferState",
                    "return PROC, DONE (only once the last byte landed) or ERR with its cause"),
    "release": ("self, handle: XferHandle | PrepHandle) -> None",
                "free a transfer or prep handle (kvt.backend.take_handle does the bookkeeping)"),
    "notify": ("self, peer: str, msg: bytes) -> None",
               "send a small message to the peer (check it with self._check_notif)"),
    "get_notifs": ("self) -> dict[str, list[bytes]]",
                   "return and clear the messages received, by sender (kvt.backend.Inbox does this)"),
}

PYPROJECT = '''[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "kvt-{name}"
version = "0.1.0"
description = "kvt backend plugin: {name}"
requires-python = ">=3.10"
dependencies = ["kvt>=0.1", "numpy>=1.24"]

[project.optional-dependencies]
test = ["kvt-conformance>=0.1", "pytest", "pytest-timeout"]

# the one line that makes this a kvt backend: NAME = "module:Class"
[project.entry-points."kvt.backends"]
{name} = "{package}.backend:{cls}"

[tool.setuptools]
packages = ["{package}"]

[tool.pytest.ini_options]
testpaths = ["tests"]
timeout = 300
'''

BACKEND_HEAD = '''"""The ``{name}`` kvt backend.

Written by ``kvt new-backend``: every verb raises ``UnsupportedOperation``
saying what to implement.  Run ``kvt conformance {name}`` (or ``pytest``
here) and implement what its failures name, verb by verb; the contract of
each verb is in kvt's docs/plugin-guide.md, and plugins/example in a kvt
checkout is a complete small backend to compare with.
"""

from __future__ import annotations

from typing import Any, Mapping

from kvt.backend import Backend
from kvt.errors import UnsupportedOperation
from kvt.types import Capabilities, Descs, MemKind, Op, PrepHandle, RegHandle, XferHandle, XferState


def _todo(verb: str, what: str) -> UnsupportedOperation:
    return UnsupportedOperation(f"{cls}.{{verb}} is not implemented yet: {{what}} "
                                f"(see docs/plugin-guide.md, '{{verb}}')")


class {cls}(Backend):
    """TODO: say what this backend moves bytes with.  Options: ``timeout``."""

    # Opt-in: declare what you build, every field.  This starts from what most
    # backends aim for, so `kvt conformance {name}` shows all that is missing;
    # set a field to False / empty where you will not support it.
    capabilities = Capabilities(mem_kinds=frozenset({{MemKind.DRAM}}), ops=frozenset(Op), notifications=True,
                                local=True, remote=True, cross_host=False, max_notif_bytes=64 * 1024,
                                cross_host_options={{}}, owner_check="server", stops_on_err=True)
    # the option keys you read besides 'timeout': kvt refuses others (a typo must not be a default)
    option_names: frozenset[str] = frozenset()

    def __init__(self, agent_name: str, options: Mapping[str, Any] | None = None):
        super().__init__(agent_name, options)  # refuses unknown keys, validates 'timeout'
'''

BACKEND_VERB = '''
    def {verb}({sig}:
        raise _todo("{verb}", "{what}")
'''

BACKEND_TAIL = '''
    def close(self) -> None:
        self._closed = True  # TODO: end in-flight transfers in ERR, free everything; idempotent
'''

TEST_MODULE = '''from kvt_conformance import ConformanceTests


class Test{camel}(ConformanceTests):
    backend_target = "{name}"
'''

README = '''# kvt-{name}

A kvt backend plugin (skeleton written by `kvt new-backend {name}`).

    pip install -e .
    kvt backends {name}        # installed, usable, what it declares
    kvt conformance {name}     # the conformance table; failures say what to implement next
    pytest                     # the same suite, through tests/test_conformance.py
'''


def _camel(name: str) -> str:
    return "".join(p.capitalize() for p in re.split(r"[-_]", name) if p)


def write_skeleton(name: str, directory: Path) -> list[Path]:
    """Write the skeleton for backend ``name`` into ``directory`` (which must
    not exist or be empty); returns the files written."""
    if not _NAME.match(name):
        raise InvalidArgument(f"backend name {name!r}: use 1-40 lowercase letters, digits, '-' or '_', "
                              "starting with a letter (it becomes the entry-point name)")
    if directory.exists() and not directory.is_dir():
        raise InvalidArgument(f"{directory} exists and is not a directory; choose a new directory")
    if directory.exists() and any(directory.iterdir()):
        raise InvalidArgument(f"{directory} exists and is not empty; choose a new directory")
    taken = [i for i in registry.list_backends() if i.name == name]
    if taken:
        raise InvalidArgument(f"a backend named {name!r} is already installed ({taken[0].dist}); two entry points "
                              "of one name make both unusable: choose another name")
    package, cls = f"kvt_{name.replace('-', '_')}", f"{_camel(name)}Backend"
    fields: dict[str, Any] = {"name": name, "package": package, "cls": cls, "camel": _camel(name)}
    backend = BACKEND_HEAD.format(**fields) + "".join(
        BACKEND_VERB.format(verb=v, sig=sig, what=what) for v, (sig, what) in VERBS.items()) + BACKEND_TAIL
    files = {"pyproject.toml": PYPROJECT.format(**fields), "README.md": README.format(**fields),
             f"{package}/__init__.py": "", f"{package}/backend.py": backend,
             "tests/test_conformance.py": TEST_MODULE.format(**fields)}
    written = []
    for rel, text in files.items():
        path = directory / rel
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError as e:
            raise InvalidArgument(f"cannot write the skeleton into {directory}: {e.strerror or e} "
                                  f"({e.filename or path}); choose a writable directory") from None
        written.append(path)
    return written


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "new-backend", help="write the skeleton of a new backend plugin",
        description="Write an installable backend plugin skeleton: pyproject.toml with the kvt.backends entry "
                    "point, a backend class whose verbs raise UnsupportedOperation naming what to implement, "
                    "and a conformance test module. Then: pip install -e DIR && kvt conformance NAME.")
    p.add_argument("name", metavar="NAME", help="the backend's entry-point name (e.g. mynet)")
    p.add_argument("directory", metavar="DIR", nargs="?", help="where to write it (default: ./kvt-NAME)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    directory = Path(args.directory or f"kvt-{args.name}")
    for path in write_skeleton(args.name, directory):
        print(path)
    print(f"next: pip install -e {directory} && kvt conformance {args.name}")
    return 0
