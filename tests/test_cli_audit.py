"""Regressions from an audit of the operator tools (``kvt backends``, ``demo``,
``bench``, ``conformance``, ``new-backend``) and the plugin registry.

Every CLI case runs the installed console script in a fresh process group
(killed whole if it overruns), so a hang fails the test instead of wedging
the run, and checks what an operator sees: exit code 2 and one line saying
what to do -- never a traceback, never a benchmark started on bad input.
Each test failed before its fix (traceback, hang, silent acceptance, or
a misleading message)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import kvt
from kvt import BackendLoadError, BackendNotFound, BackendUnavailable, registry
from kvt.bench import report

KVT = Path(sys.executable).parent / "kvt"  # the console script of the venv running the tests
KVT_ROOT = Path(kvt.__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "plugins"
BANNER = "kvt bench: "  # printed once the engines are about to run

#: the smallest bench that can run: used where a bad flag slipping through would start one
_TINY = {"--backend": "host", "--baselines": "none", "--groups": "sweep", "--ops": "READ", "--block-sizes": "4K",
         "--batches": "1", "--budget": "0.001", "--min-iters": "1", "--warmup": "0", "--rounds": "1", "--rotate": "0"}


def tiny(*flags: str, drop: tuple[str, ...] = ()) -> list[str]:
    """``kvt bench`` arguments of the smallest run, ``flags`` replacing (or adding to) them."""
    given = dict(zip(flags[::2], flags[1::2]))
    merged = {k: v for k, v in {**_TINY, **given}.items() if k not in drop}
    return ["bench", "--no-progress", *(x for kv in merged.items() for x in kv)]


def _session(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-ww", "-s", str(pid), "-o", "pid=,stat="], capture_output=True, text=True).stdout
    return [int(p) for p, st in (line.split()[:2] for line in out.splitlines()) if not st.startswith("Z")]


def _reap(p: subprocess.Popen) -> list[int]:
    """Whatever ``p`` left running in its session (then killed, so tests stay clean)."""
    left = []
    for _ in range(30):  # children get a few seconds to notice their parent is gone
        left = [q for q in _session(p.pid) if q != p.pid]
        if not left:
            break
        time.sleep(0.2)
    if left:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def start_kvt(*args: str, env: dict | None = None, cwd: Path | None = None, plugins: Path | None = None):
    e = {**os.environ, "COLUMNS": "200"}
    for var in ("KVT_BACKEND", "KVT_CONFIG", "KVT_INTEGRITY", "KVT_AUTH_KEY", "KVT_AUTH_KEY_FILE"):
        e.pop(var, None)
    if plugins:
        e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugins), e.get("PYTHONPATH")]))
    e.update(env or {})
    return subprocess.Popen([str(KVT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=cwd or KVT_ROOT, env=e)


def finish(p: subprocess.Popen, timeout: float, what: str) -> subprocess.CompletedProcess:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"`kvt {what}` did not finish within {timeout:g}s (hang); stderr: {err[-2000:]}")
    left = _reap(p)
    assert not left, f"`kvt {what}` left processes running: {left}"
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def run_kvt(*args: str, timeout: float = 90, **kw) -> subprocess.CompletedProcess:
    return finish(start_kvt(*args, **kw), timeout, " ".join(args))


def assert_refused(r: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 2 and a single ``kvt: error:`` line containing ``words``; returns it."""
    err = r.stderr.strip()
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert err.startswith("kvt: error: ") and "\n" not in err, err
    for w in words:
        assert w in err, (w, err)
    return err


# -- plugins that misbehave -----------------------------------------------------------------------

PLUGIN_MODULES = {
    "exits": "raise SystemExit(3)\n",
    "hangs": "import time\ntime.sleep(3600)\n",
    "weird": """
        import time
        from kvt import Availability, Capabilities, MemKind
        from kvt_fake_backends.doubles import FakeBackend

        class ExitingProbe(FakeBackend):
            @classmethod
            def availability(cls):
                raise SystemExit(4)

        class HangingProbe(FakeBackend):
            @classmethod
            def availability(cls):
                time.sleep(3600)

        class UnencodableCaps(FakeBackend):
            capabilities = Capabilities(mem_kinds=frozenset({MemKind.DRAM}), cross_host_options={"sock": object()})

        class WrongTypedCaps(FakeBackend):
            capabilities = Capabilities(mem_kinds=frozenset({"DRAM", 5}), ops="READ", owner_check=None)

        class NumberReason(FakeBackend):
            @classmethod
            def availability(cls):
                return Availability(False, 12345)

        class ListOptionNames(FakeBackend):
            option_names = ["timeout", "depth"]

        class ExitingConstructor(FakeBackend):
            def __init__(self, agent_name, options):
                raise SystemExit(5)
    """,
}
ENTRY_POINTS = {
    "aexits": "kvt_audit_plugins.exits:B",
    "ahangs": "kvt_audit_plugins.hangs:B",
    "aexitprobe": "kvt_audit_plugins.weird:ExitingProbe",
    "ahangprobe": "kvt_audit_plugins.weird:HangingProbe",
    "aunencodable": "kvt_audit_plugins.weird:UnencodableCaps",
    "awrongtypes": "kvt_audit_plugins.weird:WrongTypedCaps",
    "anumberreason": "kvt_audit_plugins.weird:NumberReason",
    "alistoptions": "kvt_audit_plugins.weird:ListOptionNames",
    "aexitctor": "kvt_audit_plugins.weird:ExitingConstructor",
}


@pytest.fixture(scope="module")
def audit_plugins(tmp_path_factory) -> Path:
    """A never-installed distribution whose entry points misbehave in every way
    found in the audit (next to the fixture doubles it subclasses)."""
    root = tmp_path_factory.mktemp("audit-plugins")
    dist = root / "kvt_audit_plugins-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvt-audit-plugins\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[kvt.backends]\n" + "".join(f"{n} = {v}\n" for n, v in ENTRY_POINTS.items()))
    pkg = root / "kvt_audit_plugins"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in PLUGIN_MODULES.items():
        (pkg / f"{name}.py").write_text(textwrap.dedent(text))
    return root


@pytest.fixture
def on_path(audit_plugins, monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    monkeypatch.syspath_prepend(str(audit_plugins))
    return os.pathsep.join([str(audit_plugins), str(FIXTURES)])


def test_backends_lists_the_others_when_plugins_hang_or_exit(on_path):
    # before: a plugin sleeping at import or in availability() hung `kvt backends` for ever,
    # and one calling sys.exit() ended it with no output at all
    started = time.monotonic()
    r = run_kvt("backends", "--json", "--timeout", "3", env={"PYTHONPATH": on_path}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - started < 60
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows["host"]["usable"] is True and rows["fake"]["usable"] is True
    for name in ("ahangs", "ahangprobe"):
        assert rows[name]["usable"] is False and "within 3s" in rows[name]["reason"], rows[name]
    assert "SystemExit: 3" in rows["aexits"]["reason"] and rows["aexits"]["capabilities"] is None
    assert "SystemExit: 4" in rows["aexitprobe"]["reason"] and rows["aexitprobe"]["usable"] is False


def test_backends_json_and_table_survive_malformed_declarations(on_path):
    # before: one plugin's unencodable capabilities broke --json for every backend (TypeError),
    # and a non-string availability reason broke the table
    # (and option_names as a list made the probe thread die: a thread traceback, then "it hangs" after
    # the whole probe timeout)
    started = time.monotonic()
    r = run_kvt("backends", "--json", "--timeout", "30", "host", "aunencodable", "awrongtypes", "anumberreason",
                "alistoptions", env={"PYTHONPATH": on_path})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert time.monotonic() - started < 25
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows["host"]["usable"] is True
    for name in ("aunencodable", "awrongtypes"):
        assert rows[name]["usable"] is False and "capabilities" in rows[name]["reason"], rows[name]
    assert rows["alistoptions"]["usable"] is False and "option_names" in rows["alistoptions"]["reason"]
    assert rows["anumberreason"]["usable"] is False and isinstance(rows["anumberreason"]["reason"], str)
    r = run_kvt("backends", "host", "anumberreason", "aunencodable", env={"PYTHONPATH": on_path})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "anumberreason is not usable" in " ".join(r.stdout.split())


def test_registry_turns_sys_exit_in_a_plugin_into_kvt_errors(on_path):
    # before: SystemExit escaped load_backend / create_backend (and so Agent(...)): the program just ended
    with pytest.raises(BackendLoadError, match="SystemExit: 3"):
        registry.load_backend("aexits")
    with pytest.raises(BackendUnavailable, match="SystemExit: 4"):
        registry.create_backend("aexitprobe", "a")
    with pytest.raises(BackendUnavailable, match="SystemExit: 5"):  # from its constructor
        registry.create_backend("aexitctor", "a")
    status = registry.probe("ahangprobe", timeout=0.5)
    assert not status.usable and "within 0.5s" in status.availability.reason


def test_import_kvt_imports_no_plugin(on_path):
    code = ("import sys, kvt; kvt.Agent, kvt.load_config; from kvt import registry; registry.list_backends()\n"
            "assert not [m for m in sys.modules if m.startswith(('kvt_audit_plugins', 'kvt_fake_backends'))]")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": on_path})
    assert r.returncode == 0, r.stderr


def test_config_selecting_a_broken_backend_names_the_installed_ones(on_path, monkeypatch):
    # before: only an unknown name listed the alternatives; a broken or unusable one did not
    monkeypatch.setenv("KVT_BACKEND", "broken")
    with pytest.raises(BackendLoadError) as e:
        kvt.Agent()
    assert "kvt_fake_missing_native_dep" in str(e.value) and "host" in str(e.value).split("installed backends")[1]
    assert isinstance(e.value.__cause__, ModuleNotFoundError)
    with pytest.raises(BackendUnavailable) as e:
        registry.create_backend("unusable", "a")
    assert "fake interconnect" in str(e.value) and "host" in str(e.value).split("installed backends")[1]
    with pytest.raises(BackendNotFound, match="Installed backends: .*host"):
        kvt.Agent(backend="nosuch")


# -- kvt bench ------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, says", [
    ("0", "must be positive"), ("-1", "e.g. 64K"), ("1e99", "e.g. 64K"), ("4X", "e.g. 64K")])
def test_bench_bad_block_size_says_what_a_size_is(value, says):
    # before: "'0' is not a comma-separated list of numbers" -- the size's own message was swallowed
    r = run_kvt(*tiny("--block-sizes", value))
    err = assert_refused(r, "--block-sizes", says)
    assert "comma-separated list of numbers" not in err


@pytest.mark.parametrize("flags", [
    ["--groups", "scale", "--scale", "99999999999999"],
    ["--groups", "inflight", "--inflight", "10000000000"],
    ["--groups", "sweep", "--block-sizes", "1G", "--batches", "99999999", "--max-bytes", "999999999G"],
    ["--rotate", "99999999G"],
    ["--cold", "99999999G"],
])  # (all far beyond the address space: before the fix, the children's mmap failed at once)
def test_bench_refuses_plans_larger_than_memory_before_running(flags):
    # before: the engines started and each child failed to map petabytes (OSError: Cannot
    # allocate memory, exit 1), or -- for sizes that fit the address space -- faulted in more
    # than the machine has
    r = run_kvt(*tiny(*flags, drop=("--rotate",) if "--cold" in flags else ()))
    assert_refused(r, "memory")
    assert BANNER not in r.stderr


@pytest.mark.parametrize("flags, named", [
    (["--budget", "inf"], "budget"), (["--budget", "1e300"], "budget"),
    (["--timeout", "inf"], "timeout"), (["--timeout", "1e300"], "timeout"),
    (["--warmup", "10000000000"], "warmup"), (["--min-iters", "10000000000"], "min_iters"),
    (["--rounds", "0"], "--rounds"), (["--ops", ""], "ops"),
])
def test_bench_refuses_unbounded_or_empty_settings_before_running(flags, named):
    # before: inf/1e300 seconds ran (and wrote "Infinity" into --json), 1e10 iterations ran for
    # ever, --rounds 0 silently meant 2, --ops '' said "no block size x batch fits max_bytes"
    r = run_kvt(*tiny(*flags), timeout=60)
    assert_refused(r, named)
    assert BANNER not in r.stderr


@pytest.mark.parametrize("flag, path", [
    ("--json", "/proc/kvt-audit/out.json"), ("--markdown", "/etc/passwd/out.md"), ("--plot", "/proc/out.png"),
    ("--json", "/")])
def test_bench_unwritable_output_is_refused_before_running(flag, path):
    # before: the whole sweep ran, then writing the file ended in a traceback
    r = run_kvt(*tiny(flag, path))
    assert_refused(r, flag, path)
    assert BANNER not in r.stderr


def test_bench_plot_to_a_format_matplotlib_cannot_write_is_refused_before_running(tmp_path):
    pytest.importorskip("matplotlib")
    # before: the whole sweep ran, then matplotlib's ValueError ended in a traceback
    r = run_kvt(*tiny("--plot", str(tmp_path / "plot.txt")))
    assert_refused(r, "--plot", ".txt", ".png")
    assert BANNER not in r.stderr and not (tmp_path / "plot.txt").exists()


def test_bench_option_a_backend_refuses_is_refused_before_running():
    # before: the engines ahead of it (here the memcpy baseline) ran their whole plan, then the
    # backend's processes failed on the option, and the run ended with exit 1 after the table
    r = run_kvt(*tiny("--baselines", "memcpy", "-o", "inline_bytes=-1"))
    assert_refused(r, "backend 'host'", "inline_bytes")
    assert BANNER not in r.stderr


def test_bench_plot_that_matplotlib_fails_to_write_is_one_line(tmp_path, monkeypatch, capsys):
    from kvt import cli

    pytest.importorskip("matplotlib")

    def refuse(rows, path, engines):
        raise ValueError("Format 'png' is not supported here")

    monkeypatch.setattr(report, "plot", refuse)
    assert cli.main(tiny("--plot", str(tmp_path / "plot.png"))) == 2  # before: the ValueError escaped
    assert "could not write it" in capsys.readouterr().err


def test_bench_runs_each_backend_once():
    # before: --backend host,host ran host twice, listed it twice and pooled 4 "rounds" of 1
    with_json = Path("/tmp") / f"kvt-audit-{os.getpid()}.json"
    try:
        r = run_kvt(*tiny("--backend", "host,host", "--json", str(with_json)), timeout=180)
        assert r.returncode == 0, r.stderr
        doc = json.loads(with_json.read_text())
        assert [e["name"] for e in doc["engines"]] == ["host"]
        assert [(row["engine"], row["rounds"]) for row in doc["results"]] == [("host", 1)]
    finally:
        with_json.unlink(missing_ok=True)


def test_bench_json_is_strict_json(tmp_path):
    # before: non-finite numbers were written as Infinity / NaN, which JSON parsers refuse
    path = tmp_path / "doc.json"
    report.write_json(path, {"gbps": math.inf, "rows": [{"x": math.nan, "y": 1.5}], "ok": None})

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    assert json.loads(path.read_text(), parse_constant=refuse) == {"gbps": None, "rows": [{"x": None, "y": 1.5}],
                                                                   "ok": None}


def _spawned(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-ww", "-s", str(pid), "-o", "pid=,args="], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "spawn_main" in line]


def _wait_for_children(p: subprocess.Popen, n: int, within: float = 60) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        kids = _spawned(p.pid)
        if len(kids) >= n:
            return sorted(kids)
        if p.poll() is not None:
            break
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGKILL)
    pytest.fail(f"expected {n} child processes; stderr: {p.communicate()[1][-2000:]}")


#: long enough to be interrupted: 64 MiB blocks, up to 2,000 iterations per case, 4 cases
LONG_BENCH = ["bench", "--backend", "host", "--baselines", "none", "--groups", "sweep", "--ops", "READ,WRITE",
              "--block-sizes", "64M", "--batches", "1", "--budget", "60", "--rounds", "2", "--rotate", "0",
              "--warmup", "0", "--min-iters", "1", "--no-progress"]


def test_bench_ends_when_its_target_process_is_killed():
    # before: the parent hung for ever in stop.set() -- the killed target still counted as a
    # sleeper of the multiprocessing Event it polled, and set() waits for every sleeper to wake
    p = start_kvt(*LONG_BENCH)
    target, _initiator = _wait_for_children(p, 2)
    time.sleep(1.0)  # the initiator is timing now
    os.kill(target, signal.SIGKILL)
    r = finish(p, 90, "bench (target killed)")
    assert r.returncode == 1, r.stderr
    # the initiator reports the dead peer per case, or the parent sees the target's exit first
    assert "PeerDisconnected" in r.stdout or "host target process exited with code -9" in r.stdout, r.stdout


@pytest.mark.parametrize("group", [True, False])
def test_bench_ctrl_c_stops_children_and_removes_its_files(group):
    before = set(Path("/tmp").glob("kvt-bench-*"))
    p = start_kvt(*LONG_BENCH)
    _wait_for_children(p, 2)
    time.sleep(1.0)
    (os.killpg if group else os.kill)(p.pid, signal.SIGINT)
    r = finish(p, 60, "bench (Ctrl-C)")
    assert r.returncode == 130 and r.stderr.strip().endswith("kvt: interrupted"), r.stderr
    assert "Traceback" not in r.stderr
    assert set(Path("/tmp").glob("kvt-bench-*")) <= before


# -- kvt demo -------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, named", [
    (["--layers", "0"], "--layers"), (["--block-size", "0"], "--block-size"), (["--heads", "-2"], "--heads"),
    (["--head-dim", "0"], "--head-dim"), (["--iters", "0"], "--iters"), (["--iters", "-1"], "--iters"),
    (["--timeout", "nan"], "--timeout"), (["--timeout", "inf"], "--timeout"), (["--timeout", "0"], "--timeout"),
    (["--timeout", "-1"], "--timeout"), (["--blocks", "100000000000"], "memory"),
    (["--engine", "--layers", "0"], "--layers"), (["--engine", "--timeout", "nan"], "--timeout"),
    (["--engine", "--blocks", "0"], "--blocks"), (["--in-process"], "use it with --engine"),
    # a backend that reaches only its own process (before: both processes started, then one failed)
    (["--backend", "example"], "remote=False"), (["--engine", "--backend", "example"], "remote=False"),
])
def test_demo_bad_arguments_are_refused_before_starting_processes(flags, named):
    # before: tracebacks from the children (block_len > 0, UnboundLocalError 'nbytes',
    # OverflowError), "no endpoint within nans", or an error from inside the prefill process
    r = run_kvt("demo", "--blocks", "8", "--request-blocks", "4", *flags, timeout=120)
    err = assert_refused(r, named)
    assert "prefill" not in err and "decode" not in err


def test_demo_child_failure_is_one_line_not_a_traceback(tmp_path):
    # before: an exception other than a kvt error in a child (here: torch missing) printed its traceback
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('torch is broken here (test)')\n")
    r = run_kvt("demo", "--blocks", "8", "--request-blocks", "4", "--layers", "1",
                env={"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])})
    assert_refused(r, "prefill", "torch is broken here (test)")


@pytest.mark.parametrize("how", ["KVT_AUTH_KEY", "KVT_AUTH_KEY_FILE"])
def test_demo_json_runs_with_a_key_and_never_shows_it(tmp_path, how):
    # before: --json printed the key in clear; and a key from a file failed in the children
    # ("set auth_key or auth_key_file, not both": the file was read again from the pickled config)
    key = "demo-secret-" + "x" * 32
    (tmp_path / "key").write_text(key + "\n")
    r = run_kvt("demo", "--json", "--blocks", "8", "--request-blocks", "4", "--layers", "1",
                env={how: key if how == "KVT_AUTH_KEY" else str(tmp_path / "key")})
    assert r.returncode == 0, r.stderr
    assert key not in r.stdout + r.stderr
    assert json.loads(r.stdout)["spec"]["config"]["auth_key"] == "***"


def test_engine_demo_workers_run_with_the_config_file(tmp_path):
    # before: --engine passed on only the backend and its options; the workers ran without the
    # file's auth_key (and the rest), and nothing said so
    key = "engine-secret-" + "y" * 32
    (tmp_path / "kvt.toml").write_text(f'auth_key = "{key}"\ndiscovery = "etcd://127.0.0.1:2379"\n')
    r = run_kvt("demo", "--engine", "--json", "--config", str(tmp_path / "kvt.toml"), "--requests", "3",
                "--blocks", "16", "--request-blocks", "4", "--layers", "1", timeout=180)
    assert r.returncode == 0, r.stderr
    assert key not in r.stdout + r.stderr
    ranks = [w for ws in json.loads(r.stdout)["workers"].values() for w in ws]
    assert len(ranks) == 2 and all(w["config"]["auth_key"] == "***" for w in ranks)
    assert all(w["config"]["discovery"] == "etcd://127.0.0.1:2379" for w in ranks)


@pytest.mark.parametrize("group", [True, False])
def test_demo_ctrl_c_stops_its_children(group):
    p = start_kvt("demo", "--blocks", "8", "--request-blocks", "4", "--layers", "1", "--iters", "100000000")
    _wait_for_children(p, 2)
    time.sleep(1.0)
    (os.killpg if group else os.kill)(p.pid, signal.SIGINT)
    r = finish(p, 60, "demo (Ctrl-C)")
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr


# -- kvt conformance ------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, named", [
    (["--timeout", "nan"], "--timeout"), (["--timeout", "inf"], "--timeout"), (["--timeout", "0"], "--timeout"),
    (["--timeout", "-1"], "--timeout"), (["--pytest-args", "'"], "--pytest-args"),
    (["-o", "timeout=nan"], "timeout"), (["-o", "timeout=-5"], "timeout"),
    (["--json", "/proc/kvt-audit/report.json"], "--json"), (["--junit-xml", "/etc/passwd/x.xml"], "--junit-xml"),
])
def test_conformance_bad_arguments_are_refused_before_pytest_runs(flags, named):
    # before: tracebacks (nan/inf timeouts, an unbalanced quote, the suite failing to write
    # its report), options the other commands refuse passed through, and for --timeout 0/-1
    # a full pytest start ending in "did not finish within -20s"
    r = run_kvt("conformance", "host", "-q", "-k", "zzz_audit_matches_nothing", *flags, timeout=120)
    assert_refused(r, named)


def test_conformance_says_whether_the_plugin_or_the_machine_is_at_fault():
    # before: a plugin that failed to import was "cannot run on this machine", pointing its author
    # at the machine rather than at the package
    assert_refused(run_kvt("conformance", "missingattr", "-q", plugins=FIXTURES), "failed to load (fix the plugin)")
    assert_refused(run_kvt("conformance", "unusable", "-q", plugins=FIXTURES), "cannot run on this machine")


# -- kvt new-backend ------------------------------------------------------------------------------

@pytest.mark.parametrize("directory", ["/proc/kvt-audit-skeleton", "/etc/passwd/skeleton", "afile"])
def test_new_backend_into_an_unusable_directory_is_one_line(tmp_path, directory):
    # before: FileNotFoundError / NotADirectoryError tracebacks
    (tmp_path / "afile").write_text("x")
    r = run_kvt("new-backend", "mynet", directory, cwd=tmp_path)
    assert_refused(r, directory)


def test_new_backend_refuses_the_name_of_an_installed_backend(tmp_path):
    # before: it wrote a second 'host' entry point; once installed, every use of host failed
    # ("declared by several distributions")
    r = run_kvt("new-backend", "host", str(tmp_path / "x"), cwd=tmp_path)
    assert_refused(r, "'host'", "kvt-host")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("args", [LONG_BENCH, ("demo", "--blocks", "8", "--request-blocks", "4", "--layers", "1",
                                               "--iters", "100000000", "--timeout", "600")], ids=["bench", "demo"])
def test_children_end_with_a_killed_parent(args):
    # before: a SIGKILLed `kvt bench` left its initiator running the plan, and `kvt demo`
    # left its children waiting out --timeout
    p = start_kvt(*args)
    _wait_for_children(p, 2)
    time.sleep(1.0)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(30)  # (not communicate: the children hold its pipes)
    assert not _reap(p)


def test_a_bad_option_value_names_the_flag_not_an_internal_call():
    # before: "... from load_config(options=...)", a name the command line never shows
    err = assert_refused(run_kvt("demo", "-o", "timeout=abc", timeout=60), "-o/--option", "timeout")
    assert "load_config" not in err
