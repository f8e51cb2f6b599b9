"""ConnectorWorker in one process on the host backend: registration
checks, lifecycle, and the prefill side's reader counting (the engine tests
run the same paths across processes and backends)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvt import memory
from kvt.connector import (ConnectorConfig, ConnectorScheduler, ConnectorWorker, EngineRequest, KVCacheSpec,
                           ReadNotif)
from kvt.connector.staging import HostStaging
from kvt.errors import ClosedError, InvalidArgument

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16", block_size=4)
BLOCKS = 16


def config(engine_id, tp=1, **kw):
    return ConnectorConfig(engine_id=engine_id, kv=SPEC, tp_size=tp, backend="host", **kw)


def caches(tp=1, fill=False):
    shape = (2, BLOCKS, *SPEC.block_shape(tp))
    out = {f"l{i}": memory.empty_tensor(shape, torch.float16) for i in range(SPEC.num_layers)}
    if fill:
        for t in out.values():
            t.copy_(torch.randn(shape).half())
    return out


@pytest.fixture
def workers():
    made = []

    def make(engine_id, tp=1, rank=0, fill=False, **kw):
        w = ConnectorWorker(config(engine_id, tp, **kw), rank)
        made.append(w)
        kv = caches(tp, fill)
        return w, kv, w.register_kv_caches(kv)

    yield make
    for w in made:
        w.shutdown()


def pump(workers_, until, timeout=20.0):
    """Step the workers (at least once) until ``until()``; every wait bounded."""
    deadline = time.monotonic() + timeout
    while True:
        for w, sink in workers_:
            sending, recving = w.get_finished()
            sink[0] |= sending
            sink[1] |= recving
        if until():
            return
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


def test_register_checks_shape_dtype_and_layers(workers):
    w = ConnectorWorker(config("p"))
    try:
        with pytest.raises(InvalidArgument, match="call register_kv_caches"):
            w.get_finished()
        with pytest.raises(InvalidArgument, match="num_layers=2"):
            w.register_kv_caches({"l0": torch.zeros(2, BLOCKS, 4, 4, 8, dtype=torch.float16)})
        with pytest.raises(InvalidArgument, match="does not match"):
            w.register_kv_caches({f"l{i}": torch.zeros(2, BLOCKS, 4, 8, 4, dtype=torch.float16) for i in range(2)})
        with pytest.raises(InvalidArgument, match="dtype float32"):
            w.register_kv_caches({f"l{i}": torch.zeros(2, BLOCKS, 4, 4, 8) for i in range(2)})
        with pytest.raises(InvalidArgument, match="'split' takes"):
            w.register_kv_caches({f"l{i}": torch.zeros(3, BLOCKS, 4, 4, 8, dtype=torch.float16) for i in range(2)})
        # (K, V) pairs are accepted as well as (2, ...) tensors
        kv = {f"l{i}": (torch.zeros(BLOCKS, 4, 4, 8, dtype=torch.float16),) * 2 for i in range(2)}
        assert w.register_kv_caches(kv).startswith("tcp://")
        with pytest.raises(InvalidArgument, match="already"):
            w.register_kv_caches(kv)
    finally:
        w.shutdown()


def test_shutdown_is_idempotent_and_final(workers):
    w, _, _ = workers("p")
    w.shutdown()
    w.shutdown()
    with pytest.raises(ClosedError):
        w.get_finished()


def handoff(prefill_sched, prefill_workers, block_ids, prompt_len, req_id="req"):
    """Prefill request ``req_id`` finishes and its hold reaches every prefill worker."""
    req = EngineRequest(req_id, prompt_len, {"do_remote_decode": True})
    delay, params = prefill_sched.request_finished(req, block_ids)
    assert delay
    meta = prefill_sched.build_connector_meta()
    for w in prefill_workers:
        w.start_load_kv(meta)
    return params


def test_prefill_frees_only_after_every_reader(workers):
    p, pkv, endpoint = workers("p", fill=True)
    psched = ConnectorScheduler(config("p"))
    psched.set_worker_endpoints({0: endpoint}, {0: p.agent.name})
    params = handoff(psched, [p], [3, 5, 7], 12)
    # decode TP 2 over prefill TP 1: both decode ranks read from prefill rank 0
    d0, dkv0, _ = workers("d", tp=2, rank=0)
    d1, dkv1, _ = workers("d", tp=2, rank=1)
    dsched = ConnectorScheduler(config("d", tp=2))
    req = EngineRequest("d-req", 12, dict(params))
    n, _ = dsched.get_num_new_matched_tokens(req, 0)
    dsched.update_state_after_alloc(req, [0, 1, 2], n)
    meta = dsched.build_connector_meta()
    p_done, d0_done, d1_done = [set(), set()], [set(), set()], [set(), set()]

    d0.start_load_kv(meta)
    pump([(d0, d0_done), (p, p_done)], lambda: "d-req" in d0_done[1])
    [prefill_peer] = d0.agent.peers
    d0.agent.notify(prefill_peer, ReadNotif("req", d0.consumer, 2).encode())  # the same reader again
    time.sleep(0.2)
    pump([(p, p_done)], lambda: True)
    assert p_done[0] == set()  # one of two readers (repeats count once): still held
    assert p.outstanding()["held"] == 1

    d1.start_load_kv(meta)
    pump([(d1, d1_done), (p, p_done)], lambda: "req" in p_done[0])
    assert d1_done[1] == {"d-req"} and p.stats["released_by_readers"] == 1
    for w, kv, rank in ((d0, dkv0, 0), (d1, dkv1, 1)):
        assert w.get_block_ids_with_load_errors() == set()
        for name in pkv:  # each decode rank holds its half of the heads
            assert torch.equal(kv[name][:, [0, 1, 2]], pkv[name][:, [3, 5, 7], 2 * rank:2 * rank + 2])
    for w in (p, d0, d1):
        assert not any(w.outstanding().values()), w.outstanding()


def test_numpy_caches_are_read_like_tensors(workers):
    """Engines without torch register numpy arrays (host memory)."""
    shape = (2, BLOCKS, *SPEC.block_shape(1))
    rng = np.random.default_rng(0)
    pkv = {f"l{i}": rng.standard_normal(shape).astype(np.float16) for i in range(SPEC.num_layers)}
    dkv = {f"l{i}": np.zeros(shape, np.float16) for i in range(SPEC.num_layers)}
    p, d = ConnectorWorker(config("p")), ConnectorWorker(config("d"))
    try:
        psched = ConnectorScheduler(config("p"))
        psched.set_worker_endpoints({0: p.register_kv_caches(pkv)}, {0: p.agent.name})
        d.register_kv_caches(dkv)
        params = handoff(psched, [p], [3, 5, 7], 12)
        dsched = ConnectorScheduler(config("d"))
        req = EngineRequest("d-req", 12, dict(params))
        dsched.update_state_after_alloc(req, [0, 1, 2], dsched.get_num_new_matched_tokens(req, 0)[0])
        d.start_load_kv(dsched.build_connector_meta())
        done = [set(), set()]
        pump([(d, done), (p, [set(), set()])], lambda: "d-req" in done[1])
        assert d.get_block_ids_with_load_errors() == set()
        for name in pkv:
            assert np.array_equal(dkv[name][:, [0, 1, 2]], pkv[name][:, [3, 5, 7]])
    finally:
        p.shutdown()
        d.shutdown()


def test_misuse_raises_invalid_argument(workers):
    """What an integrator gets wrong first is named, not an AttributeError
    from inside the connector."""
    with pytest.raises(InvalidArgument, match="tp_rank must be an int"):
        ConnectorWorker(config("p"), "0")
    w, _, _ = workers("p")
    for meta in (b"encoded", None, {}):  # the bytes of meta.encode(), not decoded
        with pytest.raises(InvalidArgument, match="ConnectorMetadata.decode"):
            w.start_load_kv(meta)
    fresh = ConnectorWorker(config("q"))
    try:
        with pytest.raises(InvalidArgument, match="layer name: tensor"):
            fresh.register_kv_caches(None)
    finally:
        fresh.shutdown()


def test_notification_before_the_hold(workers):
    p, _, endpoint = workers("p", fill=True)
    d, _, _ = workers("d")
    psched = ConnectorScheduler(config("p"))
    psched.set_worker_endpoints({0: endpoint}, {0: p.agent.name})
    req = EngineRequest("req", 8, {"do_remote_decode": True})
    _, params = psched.request_finished(req, [1, 2])
    dsched = ConnectorScheduler(config("d"))
    dreq = EngineRequest("d-req", 8, dict(params))
    dsched.update_state_after_alloc(dreq, [4, 5], dsched.get_num_new_matched_tokens(dreq, 0)[0])
    d_done, p_done = [set(), set()], [set(), set()]
    d.start_load_kv(dsched.build_connector_meta())  # read + notification before prefill's worker holds it
    pump([(d, d_done), (p, p_done)], lambda: "d-req" in d_done[1] and p.outstanding()["early_notifs"])
    p.start_load_kv(psched.build_connector_meta())  # the hold arrives: readers already complete
    pump([(p, p_done)], lambda: "req" in p_done[0])
    assert p.stats["released_by_readers"] == 1
    pump([(p, p_done)], lambda: True)
    assert p_done[0] == {"req"} and not any(p.outstanding().values())


def test_with_integrity_checks_the_prefill_side_holds_the_blocks_until_they_are_proven(workers, monkeypatch):
    """The reader's notification travels once the landed blocks are proven,
    not attached to the read: the prefill side freed (and could reuse) its
    blocks while they were still being digested, failing honest reads."""
    import threading

    monkeypatch.setenv("KVT_INTEGRITY", "1")
    p, _, endpoint = workers("p", fill=True)
    d, dkv, _ = workers("d")
    psched = ConnectorScheduler(config("p"))
    psched.set_worker_endpoints({0: endpoint}, {0: p.agent.name})
    params = handoff(psched, [p], [1, 2], 8)
    dsched = ConnectorScheduler(config("d"))
    dreq = EngineRequest("d-req", 8, dict(params))
    dsched.update_state_after_alloc(dreq, [4, 5], dsched.get_num_new_matched_tokens(dreq, 0)[0])
    go, asked, real = threading.Event(), threading.Event(), d.agent.ask_digests

    def held_back(*args):
        asked.set()
        assert go.wait(20)
        return real(*args)

    monkeypatch.setattr(d.agent, "ask_digests", held_back)
    d_done, p_done = [set(), set()], [set(), set()]
    d.start_load_kv(dsched.build_connector_meta())
    pump([(d, d_done), (p, p_done)], asked.is_set)  # landed, being proven
    time.sleep(0.2)
    pump([(d, d_done), (p, p_done)], lambda: True)
    assert p_done[0] == set() and p.outstanding()["held"] == 1  # still held while proven
    assert d_done[1] == set()  # and not reported loaded yet
    go.set()
    pump([(d, d_done), (p, p_done)], lambda: "req" in p_done[0] and "d-req" in d_done[1])
    assert d.get_block_ids_with_load_errors() == set() and d.stats["verified"] == 1


def _one_read(p, endpoint, d, engine, req_id, src_ids, dst_ids):
    """Hand ``req_id`` off from prefill worker ``p`` (engine ``engine``) and
    start decode worker ``d``'s read of it."""
    psched = ConnectorScheduler(config(engine))
    psched.set_worker_endpoints({0: endpoint}, {0: p.agent.name})
    params = handoff(psched, [p], src_ids, len(src_ids) * SPEC.block_size, req_id)
    dsched = ConnectorScheduler(config("d"))
    dreq = EngineRequest(f"d-{req_id}", len(src_ids) * SPEC.block_size, dict(params))
    dsched.update_state_after_alloc(dreq, dst_ids, dsched.get_num_new_matched_tokens(dreq, 0)[0])
    d.start_load_kv(dsched.build_connector_meta())


def test_with_integrity_checks_shutdown_waits_for_a_digest_of_our_blocks(workers, monkeypatch):
    """A check digests our blocks part by part between the peer's answers;
    shutdown() returned while one was still going, and once the engine freed
    its cache the next part read unmapped memory (the process segfaulted)."""
    import threading

    from kvt import integrity

    monkeypatch.setenv("KVT_INTEGRITY", "1")
    monkeypatch.setattr(integrity, "MAX_DIGEST_IDS", 1)  # one block per DigestRequest: several parts
    p, _, endpoint = workers("p", fill=True)
    d, _, _ = workers("d")
    answered, go, real = threading.Event(), threading.Event(), d.agent.ask_digests
    after_shutdown, closed, real_digest = [], threading.Event(), integrity.digest

    def slow_answer(*args):
        answered.set()
        assert go.wait(20)
        return real(*args)

    def digest(layout, ids):
        if closed.is_set() and set(layout.base_addrs) & ours:  # (the prefill side digests its own)
            after_shutdown.append(len(ids))
        return real_digest(layout, ids)

    ours = set(d.agent.info().layouts["kv"].base_addrs)
    monkeypatch.setattr(d.agent, "ask_digests", slow_answer)
    monkeypatch.setattr(integrity, "digest", digest)
    _one_read(p, endpoint, d, "p", "req", [1, 2, 3], [4, 5, 6])
    pump([(d, [set(), set()]), (p, [set(), set()])], answered.is_set)  # first part digested, its answer pending
    d.shutdown()
    closed.set()
    go.set()
    time.sleep(0.5)
    assert after_shutdown == []  # nothing of ours read once shutdown returned


@pytest.mark.parametrize("silent_id", ["silent", "good"])
def test_with_integrity_checks_a_silent_prefill_engine_does_not_hold_up_the_others(workers, monkeypatch,
                                                                                    silent_id):
    """Checks run one per connection at a time: a prefill engine whose side
    channel stopped answering digests held every checker thread, and honest
    reads from other engines failed their checks waiting.  Params naming an
    honest engine's id with another (silent) endpoint get a queue of their
    own, not the honest engine's."""
    import threading

    monkeypatch.setenv("KVT_INTEGRITY", "1")
    silent, _, silent_ep = workers(silent_id, fill=True)
    good, _, good_ep = workers("good", fill=True)
    d, _, _ = workers("d", handshake_timeout=1.0)
    stop = threading.Event()
    monkeypatch.setattr(silent.agent, "_digest", lambda req: stop.wait(20) and b"")  # never answers in time
    try:
        for i in range(40):  # ten times the checker threads, each ask waiting out handshake_timeout
            _one_read(silent, silent_ep, d, silent_id, f"s{i}", [i % 8 + 1], [i % 8 + 1])
        done = [set(), set()]
        pump([(d, done)], lambda: d.outstanding()["checks"] == 40)  # one running, 39 queued
        _one_read(good, good_ep, d, "good", "g", [1, 2], [10, 11])
        pump([(d, done), (good, [set(), set()])], lambda: "d-g" in done[1], timeout=5)
        assert not d.get_block_ids_with_load_errors() & {10, 11}
        assert d.stats["verified"] == 1
        pump([(d, done)], lambda: len(done[1]) == 41, timeout=20)  # the silent ones fail on their budget
    finally:
        stop.set()
    assert d.stats["recv_failed"] == 40
    assert d.get_block_ids_with_load_errors() == set(range(1, 9))
    pump([(d, done)], lambda: not any(d.outstanding().values()))
    # the running check may have ended after pump's last poll: the next one drops what the checks left
    d.get_finished()
    assert not d._check_queue and not d._check_running  # nothing of the failed checks kept


def test_with_integrity_checks_a_cache_off_the_host_is_refused_at_registration(monkeypatch):
    """Digests are of host memory: a device KV cache without host staging
    would fail every read's check, so it is refused when registered."""
    from kvt.errors import ConfigError

    monkeypatch.setenv("KVT_INTEGRITY", "1")
    with ConnectorWorker(config("d")) as w:
        shape = (2, BLOCKS, *SPEC.block_shape(1))
        with pytest.raises(ConfigError, match="kv_buffer_device='cpu'"):
            w.register_kv_caches({f"l{i}": torch.empty(shape, dtype=torch.float16, device="meta")
                                  for i in range(SPEC.num_layers)})


def test_notifications_for_requests_not_held_are_bounded(workers, monkeypatch):
    """A peer naming made-up requests, or one request with made-up readers,
    costs the prefill worker a bounded set-aside (oldest dropped); a real
    early reader is still honoured.  Readers that are not the sending decode
    rank are refused outright (counted as bad notifications)."""
    import kvt.connector.worker as worker_module

    monkeypatch.setattr(worker_module, "MAX_EARLY", 8)
    monkeypatch.setattr(worker_module, "MAX_EARLY_READERS", 4)
    p, _, endpoint = workers("p", fill=True)
    d, _, _ = workers("d")
    psched = ConnectorScheduler(config("p"))
    psched.set_worker_endpoints({0: endpoint}, {0: p.agent.name})
    _, params = psched.request_finished(EngineRequest("req", 8, {"do_remote_decode": True}), [1, 2])
    prefill_peer = d.agent.connect(endpoint)
    made_up_readers = [ReadNotif("made-up-49", f"reader-{i}", 1024) for i in range(50)]
    for n in made_up_readers:
        d.agent.notify(prefill_peer, n.encode())
    p_done = [set(), set()]
    pump([(p, p_done)], lambda: p.stats["bad_notifs"] == 50)
    assert not p._early
    # were they not refused (a peer that can claim any reader), one request keeps at most 4
    monkeypatch.setattr(p, "_reader_problem", lambda sender, n: None)
    flood = [ReadNotif(f"made-up-{i}", "d:0", 1) for i in range(50)]
    flood += [ReadNotif("made-up-49", f"reader-{i}", 1) for i in range(50)]
    for n in flood:
        d.agent.notify(prefill_peer, n.encode())
    held_for = lambda req_id: getattr(p._early.get(req_id), "readers", ())  # noqa: E731
    pump([(p, p_done)], lambda: p.outstanding()["early_notifs"] == 8 and len(held_for("made-up-49")) == 4)
    monkeypatch.undo()
    monkeypatch.setattr(worker_module, "MAX_EARLY", 8)
    assert "made-up-0" not in p._early  # the oldest went first
    d.agent.notify(prefill_peer, ReadNotif("req", "d:0", 1).encode())  # the real reader, before the hold
    pump([(p, p_done)], lambda: "req" in p._early)
    p.start_load_kv(psched.build_connector_meta())
    pump([(p, p_done)], lambda: "req" in p_done[0])
    assert p_done[0] == {"req"} and p.stats["released_by_readers"] == 1


def test_bad_notifications_are_counted_and_logged_at_most_once_per_quiet_period(workers, caplog):
    p, _, endpoint = workers("p")
    d, _, _ = workers("d")
    prefill_peer = d.agent.connect(endpoint)
    for i in range(20):
        d.agent.notify(prefill_peer, b"not a read notification %d" % i)
    with caplog.at_level("WARNING", logger="kvt.connector.worker"):
        pump([(p, [set(), set()])], lambda: p.stats["bad_notifs"] == 20)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [f"ignoring a notification from {d.agent.name}"]


def test_host_staging_copies_blocks_both_ways():
    device = [torch.randn(6, 2, 3), torch.randn(6, 2, 3)]
    staging = HostStaging(device)
    staging.save([1, 4])
    for d, h in zip(device, staging.host):
        assert torch.equal(h[[1, 4]], d[[1, 4]]) and not h[[0, 2, 3, 5]].any()
        h[[2]] = 7.0
    staging.load([2])
    assert all(torch.equal(d[2], torch.full((2, 3), 7.0)) for d in device)


def test_read_that_lost_its_peer_is_retried_once(workers, monkeypatch):
    """A read failing as if the prefill side had gone (a test double fails
    the first read) is retried once after a new handshake, within the lease;
    a second loss fails the request."""
    from loss_double import LossDouble

    p, pkv, endpoint = workers("p", fill=True)
    d, dkv, _ = workers("d")
    psched, dsched = ConnectorScheduler(config("p")), ConnectorScheduler(config("d"))
    psched.set_worker_endpoints({0: endpoint}, {0: p.agent.name})
    double = LossDouble(d.agent.backend, monkeypatch)
    double.hold_new = False
    for req_id, losses, blocks in (("once", 1, [1, 2]), ("twice", 2, [3, 4])):
        double.fail_next = losses
        params = handoff(psched, [p], blocks, 8, f"p-{req_id}")
        dreq = EngineRequest(f"d-{req_id}", 8, dict(params))
        dsched.update_state_after_alloc(dreq, [5, 6], dsched.get_num_new_matched_tokens(dreq, 0)[0])
        d_done = [set(), set()]
        d.start_load_kv(dsched.build_connector_meta())
        pump([(d, d_done), (p, [set(), set()])], lambda: f"d-{req_id}" in d_done[1])
        if losses == 1:
            assert d.get_block_ids_with_load_errors() == set()
            assert all(torch.equal(dkv[n][:, [5, 6]], pkv[n][:, blocks]) for n in pkv)
        else:
            assert d.get_block_ids_with_load_errors() == {5, 6}
            assert "retried once" in d.failure_reasons()[f"d-{req_id}"]
    assert d.stats["retried"] == 2 and d.stats["recv_ok"] == 1 and d.stats["recv_failed"] == 1
