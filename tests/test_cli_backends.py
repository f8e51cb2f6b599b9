"""The ``kvt`` CLI skeleton: ``--version``, ``kvt backends`` (table and
``--json``), error exit codes and defensive loading of command modules."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvt
from kvt import cli, commands

ROOT = Path(__file__).resolve().parents[1]
KVT = Path(sys.executable).parent / "kvt"  # the console script of the venv running the tests
FIXTURES = Path(__file__).parent / "fixtures"
PLUGINS = FIXTURES / "plugins"


def run_kvt(*args, extra_path=None):
    """Run the installed console script in a fresh process."""
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("KVT_BACKEND", None), env.pop("KVT_CONFIG", None)
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    return subprocess.run([str(KVT), *args], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)


@pytest.fixture
def fake_plugins(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setenv("COLUMNS", "200")  # one table row per line


def test_version_console_script():
    r = run_kvt("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"kvt {kvt.__version__}" and kvt.__version__ == "0.1.0"


def test_version_in_process(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvt {kvt.__version__}"


def test_backends_json_console_script_lists_host_usable():
    r = run_kvt("backends", "--json", extra_path=PLUGINS)
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout) if row["name"] != "dup"}
    host = rows["host"]
    assert list(host) == ["name", "entry_point", "distribution", "version", "capabilities", "usable", "reason",
                          "options", "post_path"]
    assert (host["distribution"], host["usable"], host["reason"]) == ("kvt-host", True, "")
    # the console script's process: the same environment (KVT_NATIVE) as this one
    from kvt_host.backend import HostBackend
    assert host["post_path"] == HostBackend.post_path and host["post_path"].startswith(("native (", "python ("))
    assert rows["fake"]["post_path"] is None  # one path only
    assert "transport" in host["options"] and "timeout" in host["options"]
    assert rows["fake"]["options"] is None  # declares no option_names
    assert host["capabilities"]["mem_kinds"][0] == "DRAM" and "READ" in host["capabilities"]["ops"]
    assert rows["fake"]["capabilities"] == {
        "mem_kinds": ["DRAM", "VRAM"], "ops": ["READ"], "notifications": False, "local": True,
        "remote": True, "cross_host": False, "max_notif_bytes": 0, "cross_host_options": {}, "owner_check": "", "stops_on_err": False}
    assert rows["unusable"]["usable"] is False and "fake interconnect" in rows["unusable"]["reason"]
    broken = rows["broken"]
    assert broken["capabilities"] is None and broken["usable"] is False
    assert "No module named 'kvt_fake_missing_native_dep'" in broken["reason"]


def test_backends_table(fake_plugins, capsys):
    assert cli.main(["backends"]) == 0
    out = capsys.readouterr().out
    lines = {}
    for words in filter(None, map(str.split, out.splitlines())):
        lines.setdefault(words[0], words)  # table rows come before the notes
    assert lines["fake"] == ["fake", "yes", "kvt-fake-backends", "0.3.0", "DRAM", "VRAM", "READ", "no",
                             "local,", "remote", "-"]
    assert lines["unusable"][:2] == ["unusable", "no"] and lines["broken"][:2] == ["broken", "no"]
    assert lines["host"][:4] == ["host", "yes", "kvt-host", "0.1.0"]
    # reasons follow the table, verbatim
    assert "unusable is not usable: needs the fake interconnect, which this machine lacks" in out
    assert "broken is not usable: backend 'broken'" in out


@pytest.mark.parametrize("env, says", [
    ({}, "configured: host (the default); choose another with KVT_BACKEND=NAME"),
    ({"KVT_BACKEND": "fake"}, "configured: fake (environment variable KVT_BACKEND); "),
    ({"KVT_BACKEND": "unusable"}, "configured: unusable (environment variable KVT_BACKEND, not usable here); "),
    ({"KVT_BACKEND": "hots"}, "configured: hots (environment variable KVT_BACKEND, not installed); "),
    ({"KVT_INTEGRITY": "tru"}, "configured: none: environment variable KVT_INTEGRITY='tru' is neither"),
])
def test_backends_says_which_backend_an_agent_here_would_use(fake_plugins, capsys, monkeypatch, env, says):
    for var in ("KVT_BACKEND", "KVT_CONFIG", "KVT_INTEGRITY"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert cli.main(["backends"]) == 0
    assert says in capsys.readouterr().out


def test_backends_named_subset(fake_plugins, capsys):
    assert cli.main(["backends", "--json", "fake", "unusable"]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == ["fake", "unusable"]


def test_piped_output_keeps_every_line_whole():
    # before: a pipe got rich's 80 columns: "owner check" cut to "owne", cells folded over lines
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "KVT_BACKEND", "KVT_CONFIG")}
    r = subprocess.run([str(KVT), "backends", "host"], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("name"))
    assert header.rstrip().endswith("owner check")
    (host,) = [line for line in lines if line.lstrip().startswith("host ")]
    assert "local, remote, cross-host" in host and host.rstrip().endswith("server")
    assert any(line.startswith("shared segments: ") and line.endswith(")") for line in lines)


def test_unknown_backend_exits_2_with_message_not_traceback():
    r = run_kvt("backends", "nosuch")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("kvt: error: no kvt backend named 'nosuch'.")
    assert "Traceback" not in r.stderr


def test_no_command_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "backends" in capsys.readouterr().err


def test_usage_error_exit_code(capsys):
    assert cli.main(["backends", "--no-such-flag"]) == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_command_modules_not_written_yet_are_skipped(monkeypatch, capsys):
    monkeypatch.setattr(cli, "COMMANDS", ["backends", "not_written_yet"])
    assert cli.main(["--help"]) == 0
    assert "backends" in capsys.readouterr().out


def test_command_module_with_a_missing_dependency_is_not_hidden(monkeypatch):
    # the module kvt.commands.kvt_cmd_needs_missing exists (in the fixture dir)
    # but imports a module that does not: that error must surface
    monkeypatch.setattr(commands, "__path__", [*commands.__path__, str(FIXTURES / "commands")])
    monkeypatch.setattr(cli, "COMMANDS", ["backends", "kvt_cmd_needs_missing"])
    with pytest.raises(ModuleNotFoundError, match="kvt_fake_missing_cli_dep"):
        cli.build_parser()


def test_option_values_parse_as_json_else_text(tmp_path):
    assert commands.parse_option("timeout=2.5") == ("timeout", 2.5)
    assert commands.parse_option("x=true") == ("x", True)
    assert commands.parse_option("dev=mlx5_0") == ("dev", "mlx5_0")  # not JSON: kept as text
    assert commands.parse_option('s="5"') == ("s", "5")
    parser = argparse.ArgumentParser()
    commands.add_config_arguments(parser)
    cfg = tmp_path / "kvt.toml"
    cfg.write_text('backend = "nixl"\n[backends.ucx]\ndevice = "lo"\n')
    args = parser.parse_args(["--backend", "ucx", "--config", str(cfg), "-o", "timeout=2", "-o", "a=b"])
    c = commands.config_from_args(args, listen_port=5000)
    assert (c.backend, c.listen_port, c.options) == ("ucx", 5000, {"device": "lo", "timeout": 2, "a": "b"})
    with pytest.raises(kvt.ConfigError, match="--option expects KEY=VALUE, got 'novalue'"):
        commands.parse_option("novalue")


def test_backends_table_names_the_copy_engine_and_page_kind(capsys, monkeypatch):
    from kvt import agent, memcopy, memory

    assert cli.main(["backends"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"copy engine: {memcopy.ENGINE} (" in out
    assert f"non-temporal stores: {memcopy.STREAMING}" in out
    assert f"post path: Agent {agent.POST_PATH} (" in out
    from kvt_host.backend import HostBackend
    assert f"; host {HostBackend.post_path}" in out  # each backend with a compiled post path and its twin
    assert f"shared segments: {memory.page_policy()[0]} pages (" in out
    monkeypatch.setenv("KVT_HUGEPAGES", "0")
    assert cli.main(["backends"]) == 0
    assert "shared segments: 4k pages (KVT_HUGEPAGES=0)" in " ".join(capsys.readouterr().out.split())
