"""Backend options: a key set for one backend (``-o``, ``[backends.NAME]``,
``options=``) that it does not read is a ``ConfigError`` naming it, with a
suggestion; a key of the file's shared ``[options]`` table that the chosen
backend does not read is dropped, since that table serves several backends."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvt import Agent, ConfigError, registry
from kvt.config import load_config

SHIPPED = ("host", "example", "nixl", "ucx")


#: run in a child: the backends that bundle libucx stay out of the test process (tests/connector/conftest.py)
CHILD = """
import sys
from kvt import ConfigError, registry
name = sys.argv[1]
status = registry.probe(name)
if not status.usable:
    print("unusable:", status.availability.reason); sys.exit(3)
assert registry.load_backend(name).option_names is not None, "no option_names"
try:
    registry.create_backend(name, "t", {"timout": 5, "timeout": 5})
except ConfigError as e:
    print(e)
else:
    print("accepted")
"""


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_backend_refuses_a_misspelt_option(name):
    proc = subprocess.run([sys.executable, "-c", CHILD, name], capture_output=True, text=True, timeout=120)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"no option 'timout' \(did you mean 'timeout'\?\); its options: .*timeout", proc.stdout), \
        proc.stdout


def test_agent_refuses_an_option_of_another_backend():
    with pytest.raises(ConfigError, match="no option 'ucx_env'"):
        Agent(backend="host", options={"ucx_env": {"UCX_TLS": "tcp"}})


def test_shared_table_keys_the_backend_does_not_read_are_dropped(tmp_path):
    path = tmp_path / "kvt.toml"
    path.write_text('options = { transport = "tcp", ucx_env = { UCX_TLS = "tcp" }, timeout = 7 }\n')
    config = load_config("host", path=path, env={})
    assert config.shared_options == {"transport", "ucx_env", "timeout"}
    with Agent(config=config) as agent:
        assert agent.backend.options == {"transport": "tcp", "timeout": 7}


@pytest.mark.parametrize("text, options", [
    ('[backends.host]\nucx_env = { UCX_TLS = "tcp" }\n', None),          # the backend's own table
    ('options = { ucx_env = { UCX_TLS = "tcp" } }\n', {"ucx_env": {}}),  # shared, but set again explicitly
])
def test_keys_given_for_this_backend_are_checked(tmp_path, text, options):
    path = tmp_path / "kvt.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="HostBackend has no option 'ucx_env'"):
        Agent(config=load_config("host", options, path=path, env={}))


def test_explicit_options_marked_shared_are_dropped_where_unknown():
    config = load_config("host", {"transport": "tcp", "split_bytes": 0}, env={}, shared=True)
    assert registry.own_options("host", config.options, config.shared_options) == {"transport": "tcp",
                                                                                  "timeout": 30.0}


@pytest.mark.parametrize("key, level, says", [
    ("inline_byte", "WARNING", "ignores shared option 'inline_byte' from the [options] table "
                               "(did you mean 'inline_bytes'?); its options: advertise_host, auth_key"),
    ("tranport", "WARNING", "(did you mean 'transport'?)"),
    ("split_bytes", "INFO", "backend 'host' ignores shared options ['split_bytes']"),  # the ucx backend's
    ("backends", "INFO", "backend 'host' ignores shared options ['backends']"),        # the nixl backend's
])
def test_a_shared_key_a_letter_off_an_option_is_a_warning(caplog, key, level, says):
    """A misspelt key in ``[options]`` is dropped like a key for another
    backend, but said where the default log level shows it."""
    config = load_config("host", {key: 1, "transport": "tcp"}, env={}, shared=True)
    with caplog.at_level("INFO", logger="kvt.registry"):
        assert registry.own_options("host", config.options, config.shared_options) == {"transport": "tcp",
                                                                                      "timeout": 30.0}
    records = [(r.levelname, r.getMessage()) for r in caplog.records if key in r.getMessage()]
    assert len(records) == 1 and records[0][0] == level and says in records[0][1], records


@pytest.mark.parametrize("argv", [["demo"], ["conformance", "host"]])
def test_commands_refuse_a_misspelt_option_before_starting(argv):
    kvt = Path(sys.executable).parent / "kvt"  # the console script of the venv running the tests
    proc = subprocess.run([str(kvt), *argv, "-o", "timout=5"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no option 'timout' (did you mean 'timeout'?)" in proc.stderr
    assert "Traceback" not in proc.stderr
