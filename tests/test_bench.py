"""``kvt bench``'s harness: the plan, the statistics, the timed loop, the
baselines, the process runner, the report files, and a tiny ``--quick``
run of the host backend end to end.  Functional checks only: nothing here
asserts how fast anything is."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from kvt import cli
from kvt.bench import (MEMCPY, RAW_NIXL, Case, EngineSpec, add_ratios, format_size, growth, make_plan,
                       merge_rounds, parse_size, run_engine, summarize)
from kvt.bench import report
from kvt.bench.memcpy import MemcpyEngine
from kvt.bench.plan import WARM_ROTATE
from kvt.bench.timing import measure
from kvt.config import load_config
from kvt.errors import InvalidArgument, TransferError
from kvt.types import Op

PLUGINS = Path(__file__).parent / "fixtures" / "plugins"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny_plan(**kw):
    """Two block sizes, one case per group: enough to exercise everything in seconds."""
    settings = dict(blocks=[4096, 65536], batches=[1, 4], inflight=[2], inflight_shape=(4096, 3), scale=[50, 200],
                    budget=0.001, warmup=1, min_iters=2, timeout=10)
    return make_plan(True, **{**settings, **kw})


# -- plan ---------------------------------------------------------------------

def test_parse_and_format_sizes():
    assert [parse_size(s) for s in ("4K", "4KiB", "64M", "1G", "512", " 2 kb ")] == [
        4096, 4096, 64 << 20, 1 << 30, 512, 2048]
    assert [format_size(n) for n in (4096, 64 << 20, 1 << 30, 1000)] == ["4K", "64M", "1G", "1000"]
    for bad in ("4X", "-4K", "0", "K", "1.5M"):
        with pytest.raises(InvalidArgument, match="size"):
            parse_size(bad)


def test_full_plan_sweeps_4k_to_64m_within_the_byte_cap():
    plan = make_plan()
    sweep = [c for c in plan.cases if c.group == "sweep"]
    assert {c.block for c in sweep} == {4096 << (2 * i) for i in range(8)}
    assert min(c.batch for c in sweep) == 1 and max(c.batch for c in sweep) == 4096
    assert all(c.nbytes <= 256 << 20 for c in sweep) and {c.op for c in sweep} == {Op.READ, Op.WRITE}
    assert sorted({c.inflight for c in plan.cases if c.group == "inflight"}) == [1, 8, 64]
    assert sorted({c.batch for c in plan.cases if c.group == "scale"}) == [1000, 10000, 100000]
    assert plan.arena == max(c.nbytes for c in plan.cases)
    quick = make_plan(True)
    assert len(quick.cases) < len(plan.cases) and quick.budget < plan.budget
    assert {c.op for c in quick.cases if c.group != "sweep"} == {Op.READ}  # quick: scaling rows READ only
    assert {c.op for c in quick.cases if c.group == "sweep"} == {Op.READ, Op.WRITE}


def test_plan_rejects_bad_settings_with_typed_errors():
    with pytest.raises(InvalidArgument, match="groups"):
        make_plan(groups=["sweep", "nope"])
    with pytest.raises(InvalidArgument, match="READ"):
        make_plan(ops=["copy"])
    with pytest.raises(InvalidArgument, match="batch"):
        make_plan(batches=[0, 1])
    with pytest.raises(InvalidArgument, match="empty"):
        make_plan(groups=["sweep"], blocks=[1 << 20], batches=[8], max_bytes=4096)
    with pytest.raises(InvalidArgument, match="unknown plan settings"):
        make_plan(blocksize=[4096])


@pytest.mark.parametrize("batch,inflight", [(1, 1), (2, 1), (100, 1), (16, 8)])
def test_case_ids_pair_contiguous_local_blocks_with_unmergeable_remote_ones(batch, inflight):
    case = Case("sweep", Op.READ, 4096, batch, inflight)
    ids = case.ids()
    assert ids.local.shape == ids.remote.shape == (inflight, batch)
    assert np.array_equal(ids.local.ravel(), np.arange(batch * inflight))
    assert np.array_equal(np.sort(ids.remote.ravel()), np.arange(batch * inflight))  # a permutation of the pool
    assert not (np.diff(ids.remote, axis=1) == 1).any()  # no two neighbours a backend could merge
    assert np.array_equal(case.ids().remote, ids.remote)  # every process derives the same ids


def test_a_plan_rotates_each_case_over_disjoint_blocks_filling_its_arena():
    plan = make_plan(True, groups=["sweep"], blocks=[4096, 65536], batches=[1, 4], rotate=2 << 20)
    small, big = Case("sweep", Op.READ, 4096, 1), Case("sweep", Op.READ, 65536, 4)
    assert plan.rotations(small) == 512 and plan.rotations(big) == 8  # 2 MiB / bytes per iteration
    assert plan.arena == 2 << 20 and plan.describe()["rotate_bytes"] == 2 << 20
    sets = [big.ids(k) for k in range(plan.rotations(big))]
    local = np.concatenate([i.local.ravel() for i in sets])
    remote = np.concatenate([i.remote.ravel() for i in sets])
    # every rotation its own blocks: together exactly the arena's 32 blocks of 64 KiB, once each
    assert np.array_equal(np.sort(local), np.arange(32)) and np.array_equal(np.sort(remote), np.arange(32))
    assert all(np.array_equal(np.diff(i.remote), np.diff(sets[0].remote)) for i in sets)  # same pattern
    warm = make_plan(True, groups=["sweep"], blocks=[4096, 65536], batches=[1, 4])  # default: 1 MiB per side
    assert warm.rotate == WARM_ROTATE == 1 << 20 and warm.rotations(big) == 4 and warm.rotations(small) == 256
    assert make_plan(True, groups=["sweep"], blocks=[64 << 20], batches=[1]).rotations(
        Case("sweep", Op.READ, 64 << 20, 1)) == 1  # a request of more than 1 MiB: the same blocks each time
    same = make_plan(True, groups=["sweep"], blocks=[4096, 65536], batches=[1, 4], rotate=0)
    assert same.rotations(big) == 1 and same.arena == 4 * 65536
    with pytest.raises(InvalidArgument, match="rotate"):
        make_plan(True, rotate=-1)


def test_measure_warms_every_rotation_then_cycles_through_them():
    seen = []

    class Recorder(EngineDouble):
        def post(self, case, ids, r):
            seen.append(int(ids.local[r][0]))
            return super().post(case, ids, r)

    case = Case("sweep", Op.READ, 4096, 2)
    plan = make_plan(True, budget=1e-9, warmup=1, min_iters=5, rotate=3 * 8192)
    measure(Recorder(), case, plan)
    assert seen == [0, 2, 4] + [0, 2, 4, 0, 2]  # 3 rotations of 2 blocks: each warmed once, then in turn


# -- statistics -----------------------------------------------------------------

def test_summarize_computes_medians_p99_and_bandwidth():
    case = Case("sweep", Op.WRITE, 1 << 20, 4, 2)  # 8 MiB per iteration
    post, done = [0.001, 0.002, 0.003, 0.004], [0.010, 0.010, 0.020, 0.030]
    row = summarize("host", case, post, done)
    lat = np.add(post, done)
    assert row["median_s"] == pytest.approx(np.median(lat)) == pytest.approx(0.0175)
    assert row["p99_s"] == pytest.approx(np.percentile(lat, 99))
    assert row["min_s"] == pytest.approx(0.011)
    assert row["post_s"] == pytest.approx(0.0025) and row["complete_s"] == pytest.approx(0.015)
    assert row["gbps"] == pytest.approx((8 << 20) / 0.0175 / 1e9)
    assert (row["engine"], row["op"], row["bytes"], row["iters"], row["error"]) == ("host", "WRITE", 8 << 20, 4, None)
    with pytest.raises(ValueError):
        summarize("host", case, [0.1], [])


def test_merge_rounds_pools_the_iterations_of_every_round():
    case = Case("sweep", Op.READ, 4096, 2)
    r1 = summarize("host", case, [0.001, 0.001], [0.001, 0.003])
    r2 = summarize("host", case, [0.001], [0.009])
    other = summarize("ucx", case, [0.5], [0.5])
    merged = {r["engine"]: r for r in merge_rounds([r1, other, r2])}
    host = merged["host"]
    assert (host["iters"], host["rounds"]) == (3, 2) and "samples" not in host
    assert host["median_s"] == pytest.approx(0.004)  # median of 2, 4 and 10 ms
    assert host["p99_s"] == pytest.approx(np.percentile([0.002, 0.004, 0.010], 99))
    assert (merged["ucx"]["iters"], merged["ucx"]["rounds"]) == (1, 1)
    bad = merge_rounds([r1, {**r2, "error": "TransferError: x", "samples": None}])
    assert bad[0]["error"] == "TransferError: x" and bad[0]["rounds"] == 2


def _row(engine, gbps, **case):
    c = {"group": "sweep", "op": "READ", "block": 4096, "batch": 8, "inflight": 1, **case}
    return {"engine": engine, **c, "gbps": gbps, "median_s": None if gbps is None else 1 / gbps,
            "error": None if gbps else "boom"}


def test_ratios_divide_by_the_same_case_of_each_baseline():
    rows = add_ratios([_row(MEMCPY, 10.0), _row(RAW_NIXL, 5.0), _row("host", 2.5), _row("ucx", None),
                       _row("host", 4.0, op="WRITE"), _row(MEMCPY, 8.0, op="WRITE")])
    by = {(r["engine"], r["op"]): r for r in rows}
    assert by["host", "READ"]["x_memcpy"] == pytest.approx(0.25)
    assert by["host", "READ"]["x_raw_nixl"] == pytest.approx(0.5)
    assert by[RAW_NIXL, "READ"]["x_memcpy"] == pytest.approx(0.5)
    assert by["host", "WRITE"]["x_memcpy"] == pytest.approx(0.5)
    assert by["host", "WRITE"]["x_raw_nixl"] is None  # no raw NIXL row for WRITE
    assert by["ucx", "READ"]["x_memcpy"] is None  # a failed row has no ratio


def test_growth_reports_time_factor_and_time_per_block():
    rows = [_row("host", 1.0, group="scale", batch=n) | {"median_s": t}
            for n, t in ((1000, 0.001), (10000, 0.008), (100000, 0.1))]
    (g,) = growth(rows)
    assert g["median_s"] == {1000: 0.001, 10000: 0.008, 100000: 0.1}
    assert g["blocks_factor"] == 100 and g["time_factor"] == pytest.approx(100)
    assert g["us_per_block"] == pytest.approx(1.0)


# -- the timed loop ---------------------------------------------------------------

class EngineDouble:
    """A test double of an engine: completes each request on its second poll."""

    name = "double"

    def __init__(self, fail_after=None):
        self.posts = self.released = 0
        self.fail_after = fail_after

    def post(self, case, ids, r):
        self.posts += 1
        if self.fail_after is not None and self.posts > self.fail_after:
            raise TransferError("double failed on purpose")
        return [0]

    def done(self, h):
        h[0] += 1
        return h[0] >= 2

    def release(self, h):
        self.released += 1

    def close(self):
        pass


def test_measure_runs_warmup_then_at_least_min_iters_and_at_most_max_iters():
    case = Case("inflight", Op.READ, 4096, 1, 3)
    eng = EngineDouble()
    row = measure(eng, case, make_plan(True, budget=1e-9, warmup=2, min_iters=4, rotate=0))
    assert row["iters"] == 4 and eng.posts == (2 + 4) * 3 == eng.released
    eng = EngineDouble()
    row = measure(eng, case, make_plan(True, budget=3600, warmup=0, min_iters=1, max_iters=7, rotate=0))
    assert row["iters"] == 7 and eng.posts == 21


def test_measure_turns_a_failing_engine_into_an_error_row():
    row = measure(EngineDouble(fail_after=5), Case("sweep", Op.WRITE, 4096, 1), make_plan(True, warmup=2))
    assert row["error"].startswith("TransferError: double failed") and row["gbps"] is None


def test_memcpy_baseline_moves_the_same_blocks_as_the_transfers():
    plan = tiny_plan()
    eng = MemcpyEngine(MEMCPY, plan)
    case = Case("sweep", Op.READ, 4096, 4)
    ids = case.ids()
    rblocks = eng.remote[:4 * 4096].reshape(4, 4096)
    rblocks[:] = np.arange(4, dtype=np.uint8)[:, None] + 1
    eng.post(case, ids, 0)
    lblocks = eng.local[:4 * 4096].reshape(4, 4096)
    assert np.array_equal(lblocks, rblocks[ids.remote[0]])
    lblocks[:] = 9
    eng.post(Case("sweep", Op.WRITE, 4096, 4), ids, 0)
    assert (rblocks == 9).all()


# -- processes --------------------------------------------------------------------

def test_runner_reports_an_unusable_backend_as_skipped_or_as_error_when_asked_for(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))  # spawned children inherit sys.path
    plan = tiny_plan(groups=["scale"], ops=["READ"])
    config = load_config("unusable")
    out = run_engine(EngineSpec("unusable", "kvt", config, required=False), plan, stall=60)
    assert out.status == "skipped" and "fake interconnect" in out.reason and out.rows == []
    out = run_engine(EngineSpec("unusable", "kvt", config, required=True), plan, stall=60)
    assert out.status == "error" and "fake interconnect" in out.reason


def test_runner_reports_a_backend_failing_in_its_process(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    out = run_engine(EngineSpec("fake", "kvt", load_config("fake")), tiny_plan(groups=["scale"]), stall=60)
    assert out.status == "error" and "UnsupportedOperation" in out.reason and "moves no bytes" in out.reason


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")
def test_raw_nixl_baseline_runs_in_its_own_processes():
    plan = tiny_plan(groups=["sweep"], blocks=[4096], batches=[4])
    out = run_engine(EngineSpec(RAW_NIXL, "raw-nixl"), plan, stall=120)
    assert out.status == "ok", out.reason
    assert [r["engine"] for r in out.rows] == [RAW_NIXL] * 2 and not any(r["error"] for r in out.rows)


def test_kvt_bench_quick_on_host_writes_table_json_and_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    out_json, out_png, out_md = tmp_path / "out.json", tmp_path / "out.png", tmp_path / "out.md"
    code = cli.main(["bench", "--quick", "--rounds", "2", "--backend", "host", "--baselines", "memcpy",
                     "--block-sizes", "4K,64K",
                     "--batches", "1,4", "--inflight", "1,2", "--scale", "100,1000", "--budget", "0.001",
                     "--min-iters", "2", "--no-progress", "--json", str(out_json), "--plot", str(out_png),
                     "--markdown", str(out_md)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "x memcpy" in text and "time vs blocks per transfer" in text
    doc = json.loads(out_json.read_text())
    assert doc["schema"] == report.SCHEMA
    assert [(e["name"], e["status"]) for e in doc["engines"]] == [(MEMCPY, "ok"), ("host", "ok")]
    n_cases = doc["plan"]["cases"]
    assert n_cases == 2 * 4 + 2 + 2  # sweep 2x2 x (READ, WRITE); quick: in-flight 1, 2 and scale 100, 1000 READ only
    rows = doc["results"]
    assert len(rows) == 2 * n_cases and not any(r["error"] for r in rows)
    assert doc["plan"]["rounds"] == 2 and all(r["rounds"] == 2 and "samples" not in r for r in rows)
    assert set(rows[0]) >= {"engine", "group", "op", "block", "batch", "inflight", "bytes", "iters", "gbps",
                            "median_s", "p99_s", "post_s", "complete_s", "cpu_s", "x_memcpy", "x_raw_nixl"}
    assert all(r["cpu_s"] >= 0 for r in rows)
    host = [r for r in rows if r["engine"] == "host"]
    assert all(r["x_memcpy"] > 0 and r["x_raw_nixl"] is None and r["iters"] >= 2 * 2 for r in host)
    assert {(g["engine"], g["op"]) for g in doc["growth"]} == {(MEMCPY, "READ"), ("host", "READ")}
    assert out_png.read_bytes()[:8] == PNG_MAGIC
    md = out_md.read_text()
    assert "| memcpy GB/s | host GB/s (x memcpy, x raw) |" in md and md.count("\n| scale |") == 2 + 2 * 2  # side by side, then every row


@pytest.mark.parametrize("flags,title,rotate,arena", [
    ([], "rotating over 1M", 1 << 20, 1 << 20),                       # the default: warm, 4 sets of blocks
    (["--cold", "2M"], "cold over 2M", 2 << 20, 2 << 20),
    (["--rotate", "0"], "the same blocks every iteration", 0, 4 * 65536),
])
def test_kvt_bench_rotates_each_case_as_asked_and_says_so(tmp_path, capsys, flags, title, rotate, arena):
    out_json = tmp_path / "out.json"
    code = cli.main(["bench", "--backend", "host", "--baselines", "memcpy", "--groups", "sweep", "--ops", "READ",
                     "--block-sizes", "64K", "--batches", "4", "--budget", "0.001", "--min-iters", "2",
                     "--rounds", "1", *flags, "--no-progress", "--json", str(out_json)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert title in text
    doc = json.loads(out_json.read_text())
    assert doc["plan"]["rotate_bytes"] == rotate and doc["plan"]["arena_bytes"] == arena
    assert [r["engine"] for r in doc["results"] if not r["error"]] == [MEMCPY, "host"]


def test_kvt_bench_takes_one_rotation_option():
    assert cli.main(["bench", "--rotate", "1M", "--cold"]) == 2  # --cold is a rotation too


def test_kvt_bench_unknown_backend_is_a_typed_error(capsys):
    assert cli.main(["bench", "--backend", "nosuch", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "nosuch" in err and "host" in err


def test_plot_without_matplotlib_says_how_to_install_before_running_anything(monkeypatch, capsys):
    import importlib.util

    import kvt.bench

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(kvt.bench, "run_engine", lambda *a: pytest.fail("ran an engine before failing"))
    assert cli.main(["bench", "--quick", "--backend", "host", "--plot", "x.png"]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "pip install" in err


def test_plot_needs_sweep_rows(tmp_path):
    with pytest.raises(InvalidArgument, match="sweep"):
        report.plot([_row("host", 1.0, group="scale")], tmp_path / "x.png", ["host"])
    report.plot([_row(MEMCPY, 8.0), _row("host", 2.0), _row("host", 3.0, block=65536)], tmp_path / "y.png",
                [MEMCPY, "host"])
    assert (tmp_path / "y.png").read_bytes()[:8] == PNG_MAGIC

