"""The reference engine end to end, on every usable backend: prefill and
decode engines whose TP ranks are separate processes, toy KV caches with
known contents, every decoded block verified, nothing left held.

Each test asserts the outcome of every request (status, blocks loaded,
mismatching elements), how the prefill side released its blocks (readers
vs expiry), and that no block, transfer handle, held request or pending
handshake is left anywhere (``Report.leaks``)."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import threading
import time

import pytest

from kvt.connector import reference
from kvt.connector.reference import EngineSpec, RequestSpec, ToyModel, mixed_requests, run_pd
from kvt.errors import InvalidArgument

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

MODEL = ToyModel()  # 2 layers, 4 KV heads, head_dim 8, 4-token blocks, float16
BS = MODEL.block_size


def run(backend, requests, *, ptp=1, dtp=1, model=MODEL, prefill_model=None, blocks=256, prefill=None,
        decode=None, timeout=60.0):
    p = EngineSpec("prefill", prefill_model or model, tp=ptp, num_blocks=blocks, backend=backend, **(prefill or {}))
    d = EngineSpec("decode", model, tp=dtp, num_blocks=blocks, backend=backend, handshake_timeout=1.0,
                   **(decode or {}))
    return run_pd(p, d, requests, timeout=timeout)


def stats(report, engine, key):
    return [w["stats"][key] for w in report.workers[engine]]


def assert_delivered(report, requests):
    """Every request decoded with verified contents, each whole prompt block
    read from the prefill side (minus the decode side's prefix hits)."""
    for spec in requests:
        r = report.results[spec.request_id]
        assert (r.status, r.mismatches) == ("ok", 0), r
        assert r.loaded_blocks == spec.prompt_len // BS - spec.prefix_hit_blocks, r
    assert report.leaks == {}


def with_blocks(requests):
    return sum(1 for r in requests if r.prompt_len >= BS)


def test_mixed_lengths_and_many_blocks(backend):
    requests = [*mixed_requests(10, BS, 24, seed=1), RequestSpec("many", 300 * BS + 3),
                RequestSpec("tiny", BS - 1), RequestSpec("exact", 2 * BS)]
    report = run(backend, requests, blocks=1024)
    assert_delivered(report, requests)
    assert report.results["tiny"].loaded_blocks == 0  # shorter than a block: no read, still decoded
    assert stats(report, "prefill", "released_by_readers") == [with_blocks(requests)]
    assert stats(report, "prefill", "expired") == [0]
    assert stats(report, "decode", "recv_ok") == [with_blocks(requests)]
    # the worker's timings (what bench_engine_load breaks a load down with): one per read, whole blocks
    timings = report.workers["decode"][0]["timings"]
    assert sorted(t[3] for t in timings) == sorted(r.prompt_len // BS for r in requests if r.prompt_len >= BS)
    assert all(0 <= post <= landed for post, landed, _, _ in timings)


def test_with_an_auth_key_readers_release_their_blocks(backend, monkeypatch):
    """Keyed engines seal every notification; the reads' attached ones were
    posted unsealed, so on nixl and ucx the prefill agent dropped them all
    and held every request's blocks for its whole lease (480 s by default)."""
    monkeypatch.setenv("KVT_AUTH_KEY", "engine-key-" + "q" * 32)  # the workers inherit it
    requests = mixed_requests(6, BS, 12, seed=3)
    report = run(backend, requests)
    assert_delivered(report, requests)
    assert stats(report, "prefill", "released_by_readers") == [with_blocks(requests)]
    assert stats(report, "prefill", "expired") == [0]


@pytest.mark.parametrize("ptp, dtp, kv_layout", [(1, 1, "split"), (2, 1, "split"), (1, 2, "joined")])
def test_with_integrity_checks_reads_are_proven_before_they_count(backend, monkeypatch, ptp, dtp, kv_layout):
    """KVT_INTEGRITY=1 on both engines: every read is proven against the
    prefill rank's digests before it is reported loaded, and the prefill side
    hears from the reader (and frees the blocks) only after that.  With
    heterogeneous TP each read's digests cover the slice of the blocks it read."""
    monkeypatch.setenv("KVT_INTEGRITY", "1")  # the workers inherit it
    requests = mixed_requests(6, BS, 12, seed=5)
    report = run(backend, requests, ptp=ptp, dtp=dtp, model=ToyModel(kv_layout=kv_layout))
    assert_delivered(report, requests)
    assert stats(report, "decode", "verified") == [with_blocks(requests)] * dtp
    assert stats(report, "prefill", "released_by_readers") == [with_blocks(requests)] * ptp
    assert stats(report, "prefill", "expired") == [0] * ptp


@pytest.mark.parametrize("ptp, dtp, kv_layout", [(2, 1, "split"), (1, 2, "joined")])
def test_with_integrity_checks_corrupted_reads_fail_not_load(backend, monkeypatch, ptp, dtp, kv_layout):
    """A byte flipped in every landed read (the test hook, as a corrupting
    link would leave it) fails the request with its blocks invalid; the
    checks used to prove nothing of the connector's reads, and corrupted KV
    was reported loaded.  Heterogeneous TP: the digests are of the slice of
    each prefill block that was read (a prefill rank's half of the heads, or
    a decode rank's half of a wider block)."""
    monkeypatch.setenv("KVT_INTEGRITY", "1")
    monkeypatch.setenv("KVT_INTEGRITY_TEST_FLIP", "1")
    requests = mixed_requests(4, BS, 8, seed=7)
    report = run(backend, requests, ptp=ptp, dtp=dtp, model=ToyModel(kv_layout=kv_layout))
    for spec in requests:
        r = report.results[spec.request_id]
        if spec.prompt_len >= BS:
            assert r.status == "failed" and "IntegrityError" in r.reason, r
        else:
            assert r.status == "ok", r
    assert stats(report, "decode", "verified") == [0] * dtp
    assert stats(report, "decode", "recv_failed") == [with_blocks(requests)] * dtp
    # the readers' "done, failed" notifications free the blocks: nothing waits for its lease
    assert stats(report, "prefill", "released_by_readers") == [with_blocks(requests)] * ptp
    assert report.leaks == {}


def test_prefix_hits_read_only_what_is_missing(backend):
    requests = [RequestSpec("partial", 10 * BS + 1, prefix_hit_blocks=3),
                RequestSpec("full", 6 * BS, prefix_hit_blocks=6)]
    report = run(backend, requests)
    assert_delivered(report, requests)
    # the full hit reads nothing but still tells the prefill side to free at once
    assert stats(report, "decode", "notified_only") == [1]
    assert stats(report, "prefill", "released_by_readers") == [2]
    assert stats(report, "prefill", "expired") == [0]


@pytest.mark.parametrize("ptp, dtp, kv_layout", [(2, 1, "split"), (1, 2, "joined"), (4, 2, "split"),
                                                 (2, 4, "joined"), (2, 1, "packed"), (1, 2, "packed")])
def test_heterogeneous_tensor_parallel(backend, ptp, dtp, kv_layout):
    requests = mixed_requests(6, BS, 12, seed=ptp * 10 + dtp)
    report = run(backend, requests, ptp=ptp, dtp=dtp, model=ToyModel(kv_layout=kv_layout))
    assert_delivered(report, requests)
    # every prefill rank freed every request once, and only after its readers notified
    assert stats(report, "prefill", "released_by_readers") == [with_blocks(requests)] * ptp
    assert stats(report, "prefill", "expired") == [0] * ptp
    # a decode rank reads from max(1, ptp // dtp) prefill ranks per request
    assert stats(report, "decode", "reads") == [with_blocks(requests) * max(1, ptp // dtp)] * dtp


@pytest.mark.parametrize("ptp, dtp", [(2, 1), (1, 2)])
def test_mla_replicated(backend, ptp, dtp):
    requests = mixed_requests(6, BS, 12, seed=3)
    report = run(backend, requests, ptp=ptp, dtp=dtp, model=ToyModel(kv_layout="mla", head_dim=16))
    assert_delivered(report, requests)
    assert stats(report, "prefill", "released_by_readers") == [with_blocks(requests)] * ptp
    # replicated: one read per request per decode rank, whatever the ratio
    assert stats(report, "decode", "reads") == [with_blocks(requests)] * dtp


def test_host_buffer_staging(backend):
    requests = mixed_requests(6, BS, 12, seed=4)
    report = run(backend, requests, dtp=2, prefill={"staging": True}, decode={"staging": True})
    assert_delivered(report, requests)


def test_aborts_free_immediately(backend):
    requests = [RequestSpec("prefill-abort", 5 * BS, abort="prefill"),
                RequestSpec("waiting-abort", 5 * BS, abort="decode_waiting"),
                RequestSpec("loading-abort", 5 * BS, abort="decode_loading"),
                RequestSpec("normal", 5 * BS)]
    report = run(backend, requests)
    assert {k: r.status for k, r in report.results.items()} == {
        "prefill-abort": "aborted", "waiting-abort": "aborted", "loading-abort": "aborted", "normal": "ok"}
    # the prefill-side abort held nothing; the decode-side aborts told the prefill side to free
    assert stats(report, "prefill", "released_by_readers") == [3]
    assert stats(report, "prefill", "expired") == [0]
    assert report.leaks == {}


def test_expiry(backend):
    requests = [RequestSpec("never-delivered", 5 * BS, drop=True),
                RequestSpec("delivered-late", 5 * BS, handoff_delay=2.0),
                RequestSpec("on-time", 5 * BS)]
    report = run(backend, requests, prefill={"abort_request_timeout": 1.5}, decode={"expiry_margin": 0.2})
    assert report.results["on-time"].status == "ok"
    assert report.results["never-delivered"].status == "dropped"
    late = report.results["delivered-late"]
    assert late.status == "failed" and "lease" in late.reason  # not read: the blocks may be reused
    assert stats(report, "prefill", "expired") == [2]
    assert stats(report, "decode", "recv_failed") == [1]
    assert report.leaks == {}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_handshake_failure_fails_the_request(backend):
    dead = {"remote_engine_id": "ghost", "remote_endpoints": [f"tcp://127.0.0.1:{_closed_port()}"]}
    requests = [RequestSpec("unreachable", 5 * BS, params_override=dead), RequestSpec("fine", 5 * BS)]
    report = run(backend, requests, prefill={"abort_request_timeout": 2.0})
    bad = report.results["unreachable"]
    assert bad.status == "failed" and "HandshakeTimeout" in bad.reason, bad
    assert report.results["fine"].status == "ok"
    assert stats(report, "decode", "recv_failed") == [1]
    assert report.leaks == {}


def test_transfer_failure_fails_the_request(backend):
    requests = [RequestSpec("first", 5 * BS),
                RequestSpec("bad-ids", 5 * BS, params_override={"remote_block_ids": [0, 1, 10**6, 3, 4]}),
                RequestSpec("prefill-died", 5 * BS, barrier=True, kill_prefill=True)]
    report = run(backend, requests, prefill={"abort_request_timeout": 2.0},
                 decode={"transfer_timeout": 3.0})
    assert report.results["first"].status == "ok"
    bad = report.results["bad-ids"]
    assert bad.status == "failed" and "InvalidArgument" in bad.reason, bad
    died = report.results["prefill-died"]
    assert died.status == "failed" and ("read failed" in died.reason or "did not finish" in died.reason), died
    assert stats(report, "decode", "recv_failed") == [2]
    assert report.leaks == {}  # the decode side; the prefill engine is gone


def test_incompatible_peer_is_refused(backend):
    requests = [RequestSpec("mismatch", 5 * BS)]
    report = run(backend, requests, prefill_model=ToyModel(head_dim=16), prefill={"abort_request_timeout": 1.0})
    r = report.results["mismatch"]
    assert r.status == "failed" and "IncompatiblePeer" in r.reason and "head_dim 16 (ours 8)" in r.reason, r
    assert stats(report, "decode", "reads") == [0]
    assert report.leaks == {}


def test_verification_catches_wrong_blocks(backend):
    # the router points the decode side at other blocks of the prefill cache: the
    # read succeeds, and the contents check is what catches it
    requests = [RequestSpec("wrong-blocks", 5 * BS, params_override={"remote_block_ids": [0, 1, 2, 3, 4]})]
    report = run(backend, requests, prefill={"abort_request_timeout": 5.0})
    r = report.results["wrong-blocks"]
    assert r.status == "failed" and r.mismatches > 0 and "elements differ" in r.reason, r
    assert report.leaks == {}


def test_kvt_demo_engine_prints_latency_and_throughput(capsys):
    from kvt.cli import main

    code = main(["demo", "--engine", "--backend", "host", "--requests", "5", "--layers", "2", "--heads", "2",
                 "--head-dim", "16", "--block-size", "4", "--blocks", "64", "--request-blocks", "8"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count(" ok") >= 5 and "end-to-end  median" in out and "throughput" in out and "requests/s" in out
    assert "OK: every decoded block verified, nothing leaked" in out


def test_kvt_demo_engine_in_process_runs_the_decode_worker_here(capsys):
    """``kvt demo --engine --in-process``: the decode worker in the
    command's own process (as vLLM runs tp=1), the prefill worker apart."""
    from kvt.cli import main

    code = main(["demo", "--engine", "--in-process", "--json", "--backend", "host", "--requests", "3", "--layers",
                 "2", "--heads", "2", "--head-dim", "16", "--block-size", "4", "--blocks", "64",
                 "--request-blocks", "8"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and all(r["status"] == "ok" and r["mismatches"] == 0 for r in out["results"]), out
    assert [w["pid"] for w in out["workers"]["decode"]] == [os.getpid()]
    assert out["workers"]["prefill"][0]["pid"] != os.getpid()


def test_a_decode_worker_in_the_engines_process(monkeypatch):
    """At tp=1 the decode worker can run in the scheduler's process, as vLLM
    runs tp=1: the same requests, every block read and verified, nothing
    held; the prefill worker stays a process of its own (the KV it writes
    comes from another process, as across engines).  The in-process worker
    takes each step's metadata as the object, as vLLM's executor passes it
    (the prefill worker's, in its process, still decodes it)."""
    from kvt.connector.metadata import ConnectorMetadata

    decoded, real = [], ConnectorMetadata.decode
    monkeypatch.setattr(ConnectorMetadata, "decode", staticmethod(lambda b: (decoded.append(b), real(b))[1]))
    requests = [*mixed_requests(8, BS, 16, seed=3), RequestSpec("prefix", 6 * BS, prefix_hit_blocks=2)]
    report = run("host", requests, decode={"in_process": True})
    assert decoded == []
    assert [w["pid"] for w in report.workers["decode"]] == [os.getpid()]
    assert report.workers["prefill"][0]["pid"] != os.getpid()
    assert_delivered(report, requests)
    assert stats(report, "decode", "recv_ok") == [with_blocks(requests)]
    assert stats(report, "prefill", "released_by_readers") == [with_blocks(requests)]


@pytest.mark.parametrize("change, why", [({"decode": {"in_process": True}, "dtp": 2}, "needs tp=1"),
                                         ({"prefill": {"in_process": True}}, "kill_prefill")])
def test_in_process_is_refused_where_it_cannot_hold(change, why):
    with pytest.raises(InvalidArgument, match=why):
        run("host", [RequestSpec("r", 2 * BS, kill_prefill=True)], **change)


def test_the_scheduler_waits_past_its_busy_poll_for_a_slow_reply_and_times_out(monkeypatch):
    """The reference executor busy-polls a worker's pipe briefly, then blocks:
    a reply later than the busy-poll is still taken, none within the timeout
    is ``False``, and a worker gone (pipe closed) wakes the waiter to EOF."""
    monkeypatch.setattr(reference, "_REPLY_SPIN", 0.001)
    ours, theirs = (reference._Pipe(c) for c in multiprocessing.Pipe())
    start = time.monotonic()
    assert not reference._await(ours, 0.05)
    assert time.monotonic() - start >= 0.05
    late = threading.Timer(0.05, theirs.send, (("ok", {"r1"}),))
    late.start()
    assert reference._await(ours, 10)
    assert ours.recv() == ("ok", {"r1"})
    late.join()
    theirs.close()
    assert reference._await(ours, 10)
    with pytest.raises(EOFError):
        ours.recv()
    ours.close()
