"""Regressions from the connector audit: retries after a lost peer, retired
connections, which endpoints a request reads from, how the prefill side
counts its readers, merged do_* flags, the replay guard's memory and host
staging's index handling.  One process, host backend; lost peers are test
doubles over the backend's transfer verbs (loss_double.py).  Every wait is bounded."""

from __future__ import annotations

import socket
import time
import tracemalloc

import numpy as np
import pytest
import torch

from kvt import memory
from kvt.connector import ConnectorScheduler, ConnectorWorker, EngineRequest, ReadNotif
from kvt.connector.scheduler import _Spent
from kvt.connector.staging import HostStaging, copy_blocks
from kvt.errors import UnknownPeer

from loss_double import LossDouble
from test_connector_worker import BLOCKS, SPEC, config, pump

pytestmark = pytest.mark.timeout(120)

@pytest.fixture
def workers():
    made = []

    def make(engine_id, tp=1, rank=0, fill=0.0, **kw):
        w = ConnectorWorker(config(engine_id, tp, **kw), rank)
        made.append(w)
        shape = (2, BLOCKS, *SPEC.block_shape(tp))
        kv = {f"l{i}": memory.empty_tensor(shape, torch.float16) for i in range(SPEC.num_layers)}
        for t in kv.values():
            t.fill_(fill)
        return w, kv, w.register_kv_caches(kv)

    yield make
    for w in made:
        w.shutdown()


def step(workers_, times=20):
    """A few steps of every worker, to let whatever is in flight arrive."""
    for _ in range(times):
        for w, sink in workers_:
            sending, recving = w.get_finished()
            sink[0] |= sending
            sink[1] |= recving
        time.sleep(0.005)


def handoff(psched, pws, block_ids, prompt_len, req_id):
    req = EngineRequest(req_id, prompt_len, {"do_remote_decode": True})
    delay, params = psched.request_finished(req, block_ids)
    assert delay
    meta = psched.build_connector_meta()
    for w in pws:
        w.start_load_kv(meta)
    return params


def decode(dsched, rid, params, local):
    r = EngineRequest(rid, 4 * len(local), dict(params))
    dsched.update_state_after_alloc(r, local, dsched.get_num_new_matched_tokens(r, 0)[0])


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def two_reads_in_flight(d, dsched, p1, p2, sinks):
    decode(dsched, "d-r1", p1, [5, 6])
    decode(dsched, "d-r2", p2, [7, 8])
    d.start_load_kv(dsched.build_connector_meta())
    pump(sinks, lambda: len(d._loading) == 2 and all(r.settled for r in d._loading.values()))
    return [d._loading[r].transfers[0].handle for r in ("d-r1", "d-r2")]


# -- 1: a retry always checks the prefill worker's incarnation ------------------------


def test_retry_started_on_a_connection_another_retry_made_refuses_a_restarted_prefill(workers, monkeypatch):
    """Two reads lose their peer (the prefill engine restarted on its fixed
    port); the first one's retry re-handshakes with the new process, the
    second one's retry starts at once on that connection: it must still see
    the restart and fail, not load the new process's blocks."""
    port = free_port()
    p_old, _, _ = workers("p", fill=1.0, side_channel_port=port)
    psched = ConnectorScheduler(config("p"))
    psched.set_worker_endpoints({0: f"tcp://127.0.0.1:{port}"}, {0: p_old.agent.name})
    d, dkv, _ = workers("d")
    dsched = ConnectorScheduler(config("d"))
    # params that name no agents (without auth_key a client may drop them): the retry's check alone
    p1 = {**handoff(psched, [p_old], [1, 2], 8, "p-r1"), "remote_agents": []}
    p2 = {**handoff(psched, [p_old], [3, 4], 8, "p-r2"), "remote_agents": []}
    double = LossDouble(d.agent.backend, monkeypatch)
    done = [set(), set()]
    h1, h2 = two_reads_in_flight(d, dsched, p1, p2, [(d, done)])
    double.hold_new = False
    old_remote = d._remotes["p"]

    p_old.shutdown()  # the prefill engine restarts: same port, new process, other KV
    p_new, _, _ = workers("p", fill=9.0, side_channel_port=port)
    new_sink = [set(), set()]
    double.lose(h1)
    pump([(d, done), (p_new, new_sink)], lambda: "d-r1" in done[1])
    assert d.get_block_ids_with_load_errors() == {5, 6}
    assert d._remotes["p"] is not old_remote  # re-handshaken with the new process

    double.lose(h2)
    pump([(d, done), (p_new, new_sink)], lambda: "d-r2" in done[1])
    assert d.get_block_ids_with_load_errors() == {7, 8}
    assert "restarted" in d.failure_reasons()["d-r2"]
    assert all(float(t[:, [7, 8]].max()) != 9.0 for t in dkv.values())  # nothing of the new process's
    step([(d, done), (p_new, new_sink)])
    assert d.outstanding()["loading"] == 0 and d.outstanding()["transfers"] == 0


# -- 2: retired connections sharing a peer; nothing escapes get_finished --------------


def test_reaping_an_idle_retired_connection_keeps_the_peer_a_busy_one_reads_from(workers, monkeypatch):
    p, _, ep = workers("p", fill=1.0)
    psched = ConnectorScheduler(config("p"))
    psched.set_worker_endpoints({0: ep}, {0: p.agent.name})
    d, _, _ = workers("d")
    dsched = ConnectorScheduler(config("d"))
    p1 = handoff(psched, [p], [1, 2], 8, "p-r1")
    p2 = handoff(psched, [p], [3, 4], 8, "p-r2")
    double = LossDouble(d.agent.backend, monkeypatch)
    done, psink = [set(), set()], [set(), set()]
    h1, h2 = two_reads_in_flight(d, dsched, p1, p2, [(d, done), (p, psink)])
    double.hold_new, double.fail_new = False, True  # d-r1's retry loses its peer again
    double.lose(h1)
    pump([(d, done), (p, psink)], lambda: "d-r1" in done[1])  # a second connection, retired and idle
    assert d.agent.peers, "the prefill peer was removed while d-r2 still reads from it"
    double.lose(h2)
    pump([(d, done), (p, psink)], lambda: "d-r2" in done[1])  # must not raise UnknownPeer
    assert "retried once" in d.failure_reasons()["d-r2"]
    assert d.get_block_ids_with_load_errors() == {5, 6, 7, 8}


def test_a_lost_read_whose_peer_is_unknown_fails_the_request_instead_of_raising(workers, monkeypatch):
    p, _, ep = workers("p", fill=1.0)
    psched = ConnectorScheduler(config("p"))
    psched.set_worker_endpoints({0: ep}, {0: p.agent.name})
    d, _, _ = workers("d")
    dsched = ConnectorScheduler(config("d"))
    double = LossDouble(d.agent.backend, monkeypatch)
    decode(dsched, "d-r", handoff(psched, [p], [1, 2], 8, "p-r"), [5, 6])
    done = [set(), set()]
    d.start_load_kv(dsched.build_connector_meta())
    pump([(d, done)], lambda: d._loading and all(r.settled for r in d._loading.values()))
    [h] = d._loading["d-r"].transfers

    def unknown(peer):
        raise UnknownPeer(f"test double: {peer!r} is gone")

    monkeypatch.setattr(d.agent, "peer_info", unknown)
    double.lose(h.handle)
    pump([(d, done)], lambda: "d-r" in done[1])
    assert d.get_block_ids_with_load_errors() == {5, 6}
    assert "d-r" in d.failure_reasons()


@pytest.mark.parametrize("where", ["starting", "finishing"])
def test_an_unexpected_error_in_a_read_fails_the_request_instead_of_raising(workers, monkeypatch, where):
    p, _, ep = workers("p", fill=1.0)
    psched = ConnectorScheduler(config("p"))
    psched.set_worker_endpoints({0: ep}, {0: p.agent.name})
    d, _, _ = workers("d", kv_buffer_device="cpu")
    dsched = ConnectorScheduler(config("d"))
    decode(dsched, "d-r", handoff(psched, [p], [1, 2], 8, "p-r"), [5, 6])

    def broken(*_):
        raise RuntimeError("test double: a bug")

    if where == "starting":
        monkeypatch.setattr(d, "_lease_problem", broken)
    else:  # the host -> device copy after the read landed (the engine's copy_blocks)
        monkeypatch.setattr(d._staging, "_copy", broken)
    done = [set(), set()]
    d.start_load_kv(dsched.build_connector_meta())
    pump([(d, done)], lambda: "d-r" in done[1])
    assert d.get_block_ids_with_load_errors() == {5, 6} and "a bug" in d.failure_reasons()["d-r"]


# -- 3: do_remote_prefill wins over do_remote_decode everywhere ------------------------


@pytest.mark.parametrize("auth", [False, True])
def test_params_with_both_flags_are_a_decode_request_throughout(monkeypatch, auth):
    if auth:
        monkeypatch.setenv("KVT_AUTH_KEY", "k" * 32)
    psched = ConnectorScheduler(config("p"))
    psched.set_worker_endpoints({0: "tcp://127.0.0.1:7000"}, {0: "p-tp0-abc"})
    _, params = psched.request_finished(EngineRequest("p-req", 12, {"do_remote_decode": True}), [1, 2, 3])
    dsched = ConnectorScheduler(config("d", kv_buffer_device="cpu"))
    req = EngineRequest("d-req", 12, {**params, "do_remote_decode": True})  # a router merged the flags
    assert dsched.get_num_new_matched_tokens(req, 0) == (12, True)
    dsched.update_state_after_alloc(req, [4, 5, 6], 12)
    meta = dsched.build_connector_meta()
    assert meta.reqs_to_recv["d-req"].local_block_ids == [4, 5, 6] and not meta.reqs_to_save
    assert dsched.request_finished(req, [4, 5, 6]) == (True, None)  # the read still writes into them
    dsched.update_connector_output((), {"d-req"})
    assert dsched.request_finished(req, [4, 5, 6]) == (False, None)  # not held as a prefill either
    assert not dsched.build_connector_meta() and not any(dsched.outstanding().values())
    # ended before it was scheduled: the prefill side is told to free, as for a plain decode request
    _, again = psched.request_finished(EngineRequest("p-req-2", 12, {"do_remote_decode": True}), [7, 8, 9])
    gone = EngineRequest("gone", 12, {**again, "do_remote_decode": True})
    assert dsched.request_finished(gone, [], aborted=True) == (False, None)
    assert dsched.build_connector_meta().reqs_to_recv["gone"].local_block_ids == []


def test_params_with_both_flags_load_end_to_end(workers):
    p, pkv, ep = workers("p", fill=1.0)
    psched = ConnectorScheduler(config("p"))
    psched.set_worker_endpoints({0: ep}, {0: p.agent.name})
    params = handoff(psched, [p], [1, 2, 3], 12, "p-req")
    d, dkv, _ = workers("d")
    dsched = ConnectorScheduler(config("d"))
    decode(dsched, "d-req", {**params, "do_remote_decode": True}, [4, 5, 6])
    done, psink = [set(), set()], [set(), set()]
    d.start_load_kv(dsched.build_connector_meta())
    pump([(d, done), (p, psink)], lambda: "d-req" in done[1] and "p-req" in psink[0])
    assert d.get_block_ids_with_load_errors() == set()
    assert all(torch.equal(dkv[n][:, [4, 5, 6]], pkv[n][:, [1, 2, 3]]) for n in pkv)


# -- 4: a request reads from the endpoints it names --------------------------------------


def test_a_request_naming_other_endpoints_for_a_known_engine_does_not_redirect_later_reads(workers):
    p, pkv, ep_real = workers("p", fill=1.0)
    psched = ConnectorScheduler(config("p"))
    psched.set_worker_endpoints({0: ep_real}, {0: p.agent.name})
    other, _, ep_other = workers("p", fill=6.0)  # anyone running kvt under the name 'p'
    d, dkv, _ = workers("d")
    dsched = ConnectorScheduler(config("d"))
    done, psink, osink = [set(), set()], [set(), set()], [set(), set()]
    sinks = [(d, done), (p, psink), (other, osink)]
    decode(dsched, "client-a", {"do_remote_prefill": True, "remote_block_ids": [0], "remote_engine_id": "p",
                                "remote_request_id": "whatever", "remote_endpoints": [ep_other], "tp_size": 1}, [0])
    d.start_load_kv(dsched.build_connector_meta())
    pump(sinks, lambda: "client-a" in done[1])
    params = handoff(psched, [p], [1, 2, 3], 12, "victim-prefill")
    decode(dsched, "victim", params, [5, 6, 7])
    d.start_load_kv(dsched.build_connector_meta())
    pump(sinks, lambda: "victim" in done[1])
    assert d.get_block_ids_with_load_errors() == set()
    assert all(torch.equal(dkv[n][:, [5, 6, 7]], pkv[n][:, [1, 2, 3]]) for n in pkv), "read from the other endpoint"
    pump(sinks, lambda: "victim-prefill" in psink[0])  # and the real prefill engine was told
    assert p.stats["released_by_readers"] == 1 and p.outstanding()["held"] == 0


# -- 5, 6: the prefill side's reader counting ------------------------------------------


@pytest.fixture
def half_read(workers):
    """Decode TP 2 over prefill TP 1: rank 0 has read, rank 1 has not."""
    p, _, ep = workers("p", fill=1.0)
    psched = ConnectorScheduler(config("p"))
    psched.set_worker_endpoints({0: ep}, {0: p.agent.name})
    params = handoff(psched, [p], [3, 5, 7], 12, "req")
    d0, _, _ = workers("d", tp=2, rank=0)
    d1, _, _ = workers("d", tp=2, rank=1)
    dsched = ConnectorScheduler(config("d", tp=2))
    decode(dsched, "d-req", params, [0, 1, 2])
    meta = dsched.build_connector_meta()
    pd, d0d, d1d = [set(), set()], [set(), set()], [set(), set()]
    d0.start_load_kv(meta)
    pump([(d0, d0d), (p, pd)], lambda: "d-req" in d0d[1] and p._sends["req"].readers)
    return p, pd, d0, d1, d1d, meta


@pytest.mark.parametrize("forged", ["other_tp", "other_rank"])
def test_one_decode_rank_cannot_release_blocks_other_ranks_have_not_read(half_read, forged):
    p, pd, d0, d1, d1d, meta = half_read
    [peer] = d0.agent.peers
    notif = {"other_tp": ReadNotif("req", d0.consumer, 1),  # "only one reader": the last must not win
             "other_rank": ReadNotif("req", "d:1", 2)}[forged]  # rank 0 speaking for rank 1
    bad = p.stats["bad_notifs"]
    d0.agent.notify(peer, notif.encode())
    pump([(p, pd)], lambda: p.stats["bad_notifs"] > bad or pd[0])
    assert pd[0] == set(), "released after one of two readers"
    assert p.outstanding()["held"] == 1
    d1.start_load_kv(meta)  # the real second reader still releases it
    pump([(d1, d1d), (p, pd)], lambda: "req" in pd[0])
    assert p.stats["released_by_readers"] == 1


def test_a_reader_must_be_the_sender_and_read_from_this_rank(workers):
    p1, _, _ = workers("p", tp=2, rank=1)
    assert p1._reader_problem("d-tp0-0a1b2c", ReadNotif("r", "d:0", 1)) is None  # reads prefill ranks 0, 1
    assert p1._reader_problem("d-tp1-0a1b2c", ReadNotif("r", "d:1", 2)) is None  # TP 2 over 2: rank 1 reads 1
    assert "does not read" in p1._reader_problem("d-tp0-0a1b2c", ReadNotif("r", "d:0", 2))
    assert "does not read" in p1._reader_problem("d-tp3-0a1b2c", ReadNotif("r", "d:3", 3))  # 3 is no multiple of 2
    assert "not the agent" in p1._reader_problem("e-tp1-0a1b2c", ReadNotif("r", "d:1", 2))
    assert "not 'engine:rank'" in p1._reader_problem("d-tp1-0a1b2c", ReadNotif("r", "d1", 2))


def test_a_notification_for_a_released_request_does_not_release_a_later_hold_of_that_id(workers):
    p, _, ep = workers("p", fill=1.0)
    psched = ConnectorScheduler(config("p"))
    psched.set_worker_endpoints({0: ep}, {0: p.agent.name})
    d, _, _ = workers("d")
    pd = [set(), set()]
    handoff(psched, [p], [1, 2], 8, "req")
    peer = d.agent.connect(ep)
    d.agent.notify(peer, ReadNotif("req", d.consumer, 1).encode())
    d.agent.notify(peer, ReadNotif("req", d.consumer, 1, ok=False).encode())  # a repeat, after the release
    d.agent.notify(peer, ReadNotif("marker", d.consumer, 1).encode())  # arrives after both (one sender, in order)
    pump([(p, pd)], lambda: "req" in pd[0] and "marker" in p._early)
    assert "req" not in p._early
    pd = [set(), set()]
    handoff(psched, [p], [4, 5], 8, "req")  # an engine that reuses request ids
    step([(p, pd)])
    assert pd[0] == set() and p.outstanding()["held"] == 1
    d.agent.notify(peer, ReadNotif("req", d.consumer, 1).encode())  # its real reader
    pump([(p, pd)], lambda: "req" in pd[0])


# -- 7: host staging hands block ids on as one array ---------------------------------


class NoIter(np.ndarray):
    """Block ids that must not be walked one by one in Python."""

    def __iter__(self):
        raise AssertionError("per-block Python iteration over block ids")

    def tolist(self):
        raise AssertionError("per-block Python list of block ids")


def test_host_staging_passes_block_ids_as_one_int64_array_without_walking_them():
    device = [torch.randn(8, 2, 3), torch.randn(8, 2, 3)]
    seen = []
    staging = HostStaging(device, lambda s, d, ids, direction: seen.append(ids) or copy_blocks(s, d, ids, direction))
    ids = np.asarray([1, 4, 6], np.int64).view(NoIter)
    staging.save(ids)
    for d, h in zip(device, staging.host):
        assert torch.equal(h[[1, 4, 6]], d[[1, 4, 6]]) and not h[[0, 2, 3, 5, 7]].any()
        h[2] = 7.0
    staging.load(np.asarray([2], np.int64).view(NoIter))
    assert all(torch.equal(d[2], torch.full((2, 3), 7.0)) for d in device)
    assert all(isinstance(x, np.ndarray) and x.dtype == np.int64 for x in seen)
    staging.load([3])  # a plain list still works
    assert all(torch.equal(d[3], h[3]) for d, h in zip(device, staging.host))


def test_copy_blocks_builds_the_index_once_for_every_buffer(monkeypatch):
    made = []
    real = torch.from_numpy
    monkeypatch.setattr(torch, "from_numpy", lambda a: made.append(a) or real(a))
    real_as_tensor = torch.as_tensor
    monkeypatch.setattr(torch, "as_tensor", lambda *a, **k: made.append(a) or real_as_tensor(*a, **k))
    src = [torch.randn(8, 2) for _ in range(16)]
    dst = [torch.zeros(8, 2) for _ in range(16)]
    copy_blocks(src, dst, np.asarray([0, 5], np.int64), "d2h")
    assert all(torch.equal(d[[0, 5]], s[[0, 5]]) for s, d in zip(src, dst))
    assert len(made) == 1


# -- 8: the replay guard's memory ---------------------------------------------------


def test_spent_params_expire_behind_a_far_lease_and_keep_no_long_ids():
    spent, now = _Spent(), time.time()
    spent.add(("p", "far"), 1e11, "a")  # a far expires_at at the head used to keep everything behind it
    for i in range(200):
        spent.add(("p" * 1000, f"{i:04d}" + "r" * 1000), now - 1, f"d{i}")
    spent.add(("p", "next"), now + 60, "b")
    assert len(spent._by) == 2 and spent.user(("p", "far")) == "a" and spent.user(("p", "next")) == "b"
    assert spent.user(("p" * 1000, "0000" + "r" * 1000)) is None
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(2000):  # live entries with 1 KiB ids: what is kept per entry must not grow with them
            spent.add(("e" * 1000 + str(i), "r" * 1000 + str(i)), 1e11, f"cmpl-{i}")
        per_entry = (tracemalloc.get_traced_memory()[0] - base) / 2000
    finally:
        tracemalloc.stop()
    assert per_entry < 600, per_entry
    assert spent.user(("e" * 1000 + "7", "r" * 1000 + "7")) == "cmpl-7"


# -- 9: handshakes that never answer do not hold up others ------------------------------


def test_handshakes_with_silent_endpoints_do_not_hold_up_a_real_prefill_engine(workers):
    silent = []
    try:
        for _ in range(8):  # accept TCP, never answer the side channel
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(16)
            silent.append(s)
        p, pkv, ep = workers("p", fill=1.0)
        psched = ConnectorScheduler(config("p"))
        psched.set_worker_endpoints({0: ep}, {0: p.agent.name})
        d, dkv, _ = workers("d", handshake_timeout=20.0)
        dsched = ConnectorScheduler(config("d"))
        for i, s in enumerate(silent):
            decode(dsched, f"forged-{i}", {"do_remote_prefill": True, "remote_block_ids": [0],
                                           "remote_engine_id": f"x{i}", "remote_request_id": "r",
                                           "remote_endpoints": [f"tcp://127.0.0.1:{s.getsockname()[1]}"]}, [0])
        decode(dsched, "legit-d", handoff(psched, [p], [1, 2], 8, "legit"), [5, 6])
        done = [set(), set()]
        d.start_load_kv(dsched.build_connector_meta())
        # the silent ones take handshake_timeout (20 s) each; the real one must not wait for them
        pump([(d, done), (p, [set(), set()])], lambda: "legit-d" in done[1], timeout=10.0)
        assert d.get_block_ids_with_load_errors() == set()
        assert all(torch.equal(dkv[n][:, [5, 6]], pkv[n][:, [1, 2]]) for n in pkv)
        assert d.outstanding()["handshakes"] == 8  # still waiting on the silent ones
    finally:
        for s in silent:
            s.close()


# -- a hostile prefill engine or params: bounded handshakes, nothing left loaded, typed refusals ------


def test_one_handshake_timeout_covers_every_rank_the_params_name(workers, monkeypatch):
    """Params naming 4 prefill ranks, each answering just inside the
    timeout: the handshake ends after handshake_timeout in all (it was one
    timeout per rank: up to 1,024 of them, with a request and a handshake
    thread held the while)."""
    import kvt.connector.worker as worker
    from kvt.connector.metadata import RemoteSource
    from kvt.errors import HandshakeTimeout

    given = []

    def slow_rank(endpoint, name, timeout, secret):  # a rank answering after 1.8 s of the 3 allowed
        given.append(timeout)
        time.sleep(min(1.8, timeout))
        return None

    monkeypatch.setattr(worker, "fetch_info", slow_rank)
    monkeypatch.setattr(worker, "check_peer", lambda *args, **kwargs: None)
    monkeypatch.setattr(worker.WorkerCard, "from_info", staticmethod(lambda info: None))
    d, _, _ = workers("d", handshake_timeout=3.0)
    src = RemoteSource(engine_id="x", request_id="r", block_ids=[0], tp_size=4,
                       endpoints=[f"tcp://127.0.0.1:{1000 + r}" for r in range(4)])
    with pytest.raises(HandshakeTimeout):
        d._handshake(src)
    assert len(given) == 2 and given[1] < 1.5, given  # the second rank got what was left (<= 1.2 s)


def test_a_handshake_failing_after_some_ranks_loaded_unloads_them(workers):
    """A TP-2 prefill engine whose rank 1 publishes a layout that cannot be
    cut as rank 0's (a smaller block at the top of the address space): the
    request fails with IncompatiblePeer and the ranks already loaded are
    unloaded (a ValueError skipped that, and every such request left its
    peers loaded for good)."""
    import threading

    import msgspec
    import zmq
    from kvt.agent import fetch_info
    from kvt.wire import HandshakeReply, encode

    def serve(info):
        s = zmq.Context.instance().socket(zmq.REP)
        s.setsockopt(zmq.LINGER, 0)
        port = s.bind_to_random_port("tcp://127.0.0.1")

        def answer():
            s.recv()
            s.send(encode(HandshakeReply(payload=encode(info))))
            s.close()
        threading.Thread(target=answer, daemon=True).start()
        return f"tcp://127.0.0.1:{port}"

    d, _, _ = workers("d")
    dsched = ConnectorScheduler(config("d"))
    (_, _, ep0), (_, _, ep1) = workers("x", tp=2, rank=0), workers("x", tp=2, rank=1)
    i0, i1 = fetch_info(ep0, "t", 5.0), fetch_info(ep1, "t", 5.0)
    lay = i1.layouts["kv"]
    small = lay.block_len // 2
    top = (1 << 64) - ((lay.num_blocks - 1) * lay.stride + small)
    i1 = msgspec.structs.replace(i1, layouts={"kv": msgspec.structs.replace(
        lay, block_len=small, base_addrs=[top] * len(lay.base_addrs))})
    decode(dsched, "q", {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "x",
                         "remote_request_id": "r", "tp_size": 2, "remote_endpoints": [serve(i0), serve(i1)]}, [2])
    done = [set(), set()]
    d.start_load_kv(dsched.build_connector_meta())
    pump([(d, done)], lambda: "q" in done[1])
    assert "IncompatiblePeer" in d.failure_reasons()["q"]
    assert not d.agent.peers


@pytest.mark.parametrize("field", ["tp_size", "remote_block_ids", "remote_engine_id", "remote_host"])
def test_params_with_a_lone_surrogate_are_malformed_not_a_unicode_error(field):
    """Python's json keeps lone surrogates ("\\ud800"); they raised
    UnicodeEncodeError out of the scheduler (parsing, signing, or encoding
    the step's metadata, losing every read of that step)."""
    from kvt.errors import InvalidArgument

    params = {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "x",
              "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 5600,
              field: "\ud800" if field != "remote_block_ids" else ["\ud800"]}
    dsched = ConnectorScheduler(config("d"))
    with pytest.raises(InvalidArgument, match="malformed"):
        dsched.get_num_new_matched_tokens(EngineRequest("q", 8, params), 0)
    dsched.build_connector_meta().encode()  # the step goes on


def _prefill_scheduler():
    psched = ConnectorScheduler(config("p"))
    psched.set_worker_endpoints({0: "tcp://127.0.0.1:7000"}, {0: "p-tp0-abc"})
    return psched


@pytest.mark.parametrize("bad_id", ["cmpl-\ud800-0", 7, "r" * 1025])
def test_a_request_id_that_cannot_travel_is_refused_before_any_state(bad_id):
    """A client's JSON request id with a lone surrogate (or a non-str id)
    was recorded for hand-off first, then failed to encode: that step's
    metadata was lost, a valid request's hold with it."""
    from kvt.connector.metadata import ConnectorMetadata
    from kvt.errors import InvalidArgument

    psched = _prefill_scheduler()
    assert psched.request_finished(EngineRequest(bad_id, 12, {"do_remote_decode": True}), [4, 5, 6]) == (False, None)
    delay, params = psched.request_finished(EngineRequest("fine", 12, {"do_remote_decode": True}), [1, 2, 3])
    assert delay and params["remote_block_ids"] == [1, 2, 3]
    meta = ConnectorMetadata.decode(psched.build_connector_meta().encode())
    assert set(meta.reqs_to_send) == {"fine"}
    dsched = ConnectorScheduler(config("d"))
    req = EngineRequest(bad_id, 12, dict(params))
    with pytest.raises(InvalidArgument, match="cannot travel"):  # the decode side: computed locally
        dsched.get_num_new_matched_tokens(req, 0)
    with pytest.raises(InvalidArgument, match="cannot travel"):
        dsched.update_state_after_alloc(req, [0, 1, 2], 12)
    dsched.build_connector_meta().encode()
    # a plain request is not the connector's business, whatever its id
    assert dsched.get_num_new_matched_tokens(EngineRequest(bad_id, 12, None), 0) == (0, False)


def test_numpy_block_ids_are_handed_off_and_scheduled():
    """numpy ids were accepted, then failed to encode in the step's metadata."""
    from kvt.connector.metadata import ConnectorMetadata

    psched = _prefill_scheduler()
    _, params = psched.request_finished(EngineRequest("p", 12, {"do_remote_decode": True}), np.array([4, 5, 6]))
    assert params["remote_block_ids"] == [4, 5, 6] and type(params["remote_block_ids"][0]) is int
    psched.build_connector_meta().encode()
    dsched = ConnectorScheduler(config("d"))
    req = EngineRequest("d", 12, dict(params))
    n, _ = dsched.get_num_new_matched_tokens(req, 0)
    dsched.update_state_after_alloc(req, np.arange(3), n)
    meta = ConnectorMetadata.decode(dsched.build_connector_meta().encode())
    assert meta.reqs_to_recv["d"].local_block_ids == [0, 1, 2]


@pytest.mark.parametrize("endpoint", ["garbage", "tcp://h:abc", 5, None])
def test_worker_endpoints_are_checked_when_set(endpoint):
    from kvt.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="tcp://host:port"):
        ConnectorScheduler(config("p")).set_worker_endpoints({0: endpoint}, {0: "p-tp0-abc"})


@pytest.mark.parametrize("params", ["do_remote_prefill", ["x"], 5])
def test_params_that_are_not_an_object_never_raise_past_a_typed_refusal(params):
    """get_num_new_matched_tokens refused them; update_state_after_alloc and
    request_finished raised AttributeError (into the engine's step)."""
    from kvt.errors import InvalidArgument

    sched = _prefill_scheduler()
    req = EngineRequest("r", 12, params)
    with pytest.raises(InvalidArgument):
        sched.get_num_new_matched_tokens(req, 0)
    with pytest.raises(InvalidArgument):
        sched.update_state_after_alloc(req, [0, 1, 2], 12)
    assert sched.request_finished(req, [0, 1, 2]) == (False, None)
    sched.build_connector_meta().encode()
