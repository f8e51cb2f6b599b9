"""The connector's pure parts: TP math, config, messages, compatibility
check and the scheduler side (no network, no backend)."""

from __future__ import annotations

import logging
import time

import msgspec
import numpy as np
import pytest

from kvt.connector import (ConnectorConfig, ConnectorMetadata, ConnectorScheduler, EngineRequest,
                           FinishedAggregator, KVCacheSpec, ReadNotif, TransferParams)
from kvt.auth import Secret
from kvt.connector.compat import WorkerCard, check_peer
from kvt.connector.scheduler import _Spent
from kvt.connector.tp import Slice, part_layout, plan_reads, readers_per_rank, remote_ranks
from kvt.errors import ConfigError, IncompatiblePeer, InvalidArgument, WireError
from kvt.wire import AgentInfo, BlockLayout

SPEC = KVCacheSpec(model="m", num_layers=2, num_kv_heads=8, head_dim=16, dtype="float16", block_size=4)


def config(engine_id="e", tp=1, **kw):
    return ConnectorConfig(engine_id=engine_id, kv=SPEC, tp_size=tp, **kw)


# -- tensor parallelism -----------------------------------------------------------


@pytest.mark.parametrize("rank, local_tp, remote_tp, want", [
    (0, 1, 1, [0]), (3, 2 * 2, 2, [1]), (2, 4, 1, [0]),   # decode TP >= prefill TP: r // ratio
    (0, 1, 2, [0, 1]), (1, 2, 4, [2, 3]),                  # prefill TP > decode TP: a group
])
def test_remote_ranks(rank, local_tp, remote_tp, want):
    assert remote_ranks(rank, local_tp, remote_tp) == want


def test_decode_rank_reads_its_slice_of_heads():
    # decode TP 4 over prefill TP 2: rank 3 reads the 2nd half of prefill rank 1's parts
    plan = plan_reads(3, 4, 2, local_part=100, remote_part=200, replicated=False)
    [read] = plan.reads
    assert (read.remote_rank, read.local, read.remote) == (1, Slice(0, 100), Slice(100, 100))
    assert plan.notify_only == ()


def test_decode_rank_assembles_parts_from_several_prefill_ranks():
    plan = plan_reads(1, 2, 4, local_part=200, remote_part=100, replicated=False)
    assert [(r.remote_rank, r.local, r.remote) for r in plan.reads] == [
        (2, Slice(0, 100), Slice(0, 100)), (3, Slice(100, 100), Slice(0, 100))]


def test_replicated_reads_once_and_notifies_the_rest():
    plan = plan_reads(0, 1, 2, local_part=64, remote_part=64, replicated=True)
    assert [r.remote_rank for r in plan.reads] == [0] and plan.notify_only == (1,)
    assert plan.ranks == (0, 1)


@pytest.mark.parametrize("args", [
    (0, 2, 1, 100, 100, False),   # prefill part should be twice ours
    (0, 1, 2, 100, 100, False),   # ours should be twice the prefill part
    (0, 1, 1, 64, 32, True),      # replicated parts differ
    (0, 3, 2, 100, 100, False),   # TP sizes do not divide
])
def test_plan_refuses_parts_that_do_not_fit(args):
    with pytest.raises(IncompatiblePeer):
        plan_reads(*args)


def test_readers_per_rank():
    assert [readers_per_rank(p, d) for p, d in [(1, 1), (1, 4), (2, 4), (4, 2), (4, 1)]] == [1, 4, 2, 1, 1]


def test_part_layout_addresses_slices_of_parts():
    lay = BlockLayout(base_addrs=[1000, 9000], block_len=40, num_blocks=3, stride=40)
    sub = part_layout(lay, parts=2, sl=Slice(5, 10))  # K and V halves of 20 B, bytes 5..15 of each
    assert sub.base_addrs == [1005, 1025, 9005, 9025]
    assert (sub.block_len, sub.stride, sub.num_blocks) == (10, 40, 3)
    rows = sub.descs().array
    assert rows[:, 0].tolist() == [1005, 1045, 1085, 1025, 1065, 1105, 9005, 9045, 9085, 9025, 9065, 9105]
    assert set(rows[:, 1].tolist()) == {10}


# -- configuration ----------------------------------------------------------------


def test_the_timeouts_come_from_the_kvt_config_file_unless_the_connector_sets_them(tmp_path, monkeypatch):
    # before: the connector's own defaults (5 s, 30 s) overrode the file's, silently
    (tmp_path / "kvt.toml").write_text("transfer_timeout = 12\nhandshake_timeout = 1\n")
    monkeypatch.setenv("KVT_CONFIG", str(tmp_path / "kvt.toml"))
    got = config().kvt_config()
    assert (got.transfer_timeout, got.handshake_timeout) == (12, 1)
    got = config(transfer_timeout=7.0).kvt_config()
    assert (got.transfer_timeout, got.handshake_timeout) == (7, 1)
    monkeypatch.delenv("KVT_CONFIG")
    got = config().kvt_config()
    assert (got.transfer_timeout, got.handshake_timeout) == (30, 5)


def test_config_from_dict_names_the_bad_field():
    with pytest.raises(ConfigError, match="tp_size"):
        ConnectorConfig.from_dict({"engine_id": "e", "kv": msgspec.to_builtins(SPEC), "tp_size": 0})
    with pytest.raises(ConfigError, match="engine_id"):  # its reader names would be refused by peers
        ConnectorConfig.from_dict({"engine_id": "e" * 201, "kv": msgspec.to_builtins(SPEC)})
    with pytest.raises(ConfigError, match="multiple of tp_size"):
        config(tp=3)
    with pytest.raises(ConfigError, match="dtype"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float13", block_size=1)


@pytest.mark.parametrize("build", [
    lambda: ConnectorConfig(engine_id="e", kv=SPEC, tp_size=0),  # ZeroDivisionError
    lambda: ConnectorConfig(engine_id="e", kv=msgspec.to_builtins(SPEC)),  # AttributeError
    lambda: ConnectorConfig(engine_id="e", kv=SPEC, tp_size="2"),  # TypeError
    lambda: ConnectorConfig.from_dict(None),
    lambda: ConnectorConfig.from_dict([1]),
    lambda: ConnectorConfig.from_dict("abc"),
])
def test_config_built_wrongly_is_a_config_error(build):
    with pytest.raises(ConfigError):
        build()


def test_config_shapes_and_fixed_endpoints():
    cfg = config(tp=2, side_channel_port=7000)
    assert cfg.kv.block_shape(2) == (4, 4, 16) and cfg.kv.part_bytes(2) == 4 * 4 * 16 * 2
    assert [cfg.endpoint(r) for r in range(2)] == ["tcp://127.0.0.1:7000", "tcp://127.0.0.1:7001"]
    assert config().endpoint(0) is None


# -- messages ---------------------------------------------------------------------


def test_metadata_round_trips_and_rejects_garbage():
    sched = prefill("e")
    req = EngineRequest("r", 9, {"do_remote_decode": True})
    sched.request_finished(req, [4, 5, 6])
    meta = sched.build_connector_meta()
    assert ConnectorMetadata.decode(meta.encode()) == meta
    with pytest.raises(WireError):
        ConnectorMetadata.decode(b"\x01garbage")
    with pytest.raises(WireError):
        ReadNotif.decode(b"not a notification")
    n = ReadNotif("r", "d:0", 2)
    assert ReadNotif.decode(n.encode()) == n
    for bad in (ReadNotif("r", "d:0", 0), ReadNotif("r", "d:0", 1025), ReadNotif("r", "d" * 257, 1),
                ReadNotif("r" * 1025, "d:0", 1)):  # a peer's: bounded before it is kept
        with pytest.raises(WireError):
            ReadNotif.decode(bad.encode())


def test_transfer_params_parse():
    assert TransferParams.parse(None) is None
    p = TransferParams.parse({"do_remote_prefill": True, "remote_host": "h", "remote_port": 5, "tp_size": 2,
                              "router_field": "ignored"})
    assert p.endpoints() == ["tcp://h:5", "tcp://h:6"]
    assert "remote_engine_id" in p.source_problem()
    with pytest.raises(InvalidArgument, match="kv_transfer_params"):
        TransferParams.parse({"remote_block_ids": "not a list"})
    assert "version" in TransferParams(kvt_version=99).source_problem()
    ok = TransferParams.parse({"remote_endpoints": ["tcp://10.0.0.5:5555", "tcp://[::1]:65535"], "tp_size": 2,
                               "remote_block_ids": [0, 2**63 - 1]})
    assert ok.endpoints() == ["tcp://10.0.0.5:5555", "tcp://[::1]:65535"]


@pytest.mark.parametrize("hostile", [
    {"remote_host": "h", "remote_port": 7000, "tp_size": 30_000_000},  # would build 30M endpoint strings
    {"remote_host": "h", "remote_port": 7000, "tp_size": 0},  # no endpoints needed, then a division by zero
    {"remote_host": "h", "remote_port": 70000},
    {"remote_host": "h", "remote_port": 65535, "tp_size": 2},
    {"remote_host": "h/x y", "remote_port": 7000},
    {"remote_endpoints": ["ipc:///run/some.sock"]},  # kvt serves tcp only: nothing else is connected to
    {"remote_endpoints": ["inproc://vllm-internal"]},
    {"remote_endpoints": ["tcp://h:99999"]},
    {"remote_endpoints": ["tcp://h:0"]},  # no one serves port 0: it held a handshake thread, then failed the load
    {"remote_endpoints": ["tcp://h:00000"]},
    {"remote_endpoints": ["tcp://h:1"] * 1025, "tp_size": 1025},
    {"remote_block_ids": [1, -1]},
    {"remote_block_ids": [2**63]},
    {"remote_engine_id": "e" * 1025},
    {"kvt_mac": "\u00e9" * 64},  # hmac.compare_digest raises TypeError on non-ASCII str
    {"kvt_mac": "ab"},
    {"expires_at": float("nan")},  # never expires, never leaves the replay memory
    {"expires_at": float("inf")},
])
def test_transfer_params_refuse_what_a_client_could_abuse(hostile):
    """kv_transfer_params come from whoever sends the decode engine requests."""
    base = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r", "remote_block_ids": [1]}
    with pytest.raises(InvalidArgument, match="malformed kv_transfer_params"):
        TransferParams.parse({**base, **hostile})


@pytest.mark.parametrize("not_an_object", [[1, 2], "abc", 5, [("do_remote_prefill", True)]])
def test_transfer_params_that_are_not_an_object_are_refused(not_an_object):
    with pytest.raises(InvalidArgument, match="not a JSON object"):
        TransferParams.parse(not_an_object)


# -- compatibility ----------------------------------------------------------------


def card(spec=SPEC, **kw):
    return WorkerCard(**{"engine_id": "p", "tp_rank": 0, "tp_size": 1, "spec": spec, "layers": ["a", "b"],
                         "parts": 1, **kw})


def test_check_peer_lists_every_mismatch():
    theirs = card(msgspec.structs.replace(SPEC, dtype="bfloat16", block_size=16), layers=["x", "y"])
    with pytest.raises(IncompatiblePeer) as e:
        check_peer(card(engine_id="d"), theirs, engine_id="p", rank=0, tp_size=1)
    msg = str(e.value)
    assert "dtype 'bfloat16' (ours 'float16')" in msg and "block_size 16 (ours 4)" in msg and "layers" in msg


def test_check_peer_checks_identity_and_layout_for_heterogeneous_tp():
    check_peer(card(engine_id="d"), card(), engine_id="p", rank=0, tp_size=1)  # compatible: no error
    with pytest.raises(IncompatiblePeer, match="engine id 'p'"):
        check_peer(card(engine_id="d"), card(), engine_id="other", rank=0, tp_size=1)
    with pytest.raises(IncompatiblePeer, match="TP rank 0/1 \\(expected 1/2\\)"):
        check_peer(card(engine_id="d"), card(), engine_id="p", rank=1, tp_size=2)
    nhd = msgspec.structs.replace(SPEC, head_layout="NHD")
    with pytest.raises(IncompatiblePeer, match="HND"):
        check_peer(card(nhd, engine_id="d", tp_size=2), card(nhd, tp_size=1), engine_id="p", rank=0, tp_size=1)


def test_a_peer_without_a_card_is_refused():
    with pytest.raises(IncompatiblePeer, match="not a kvt connector worker"):
        WorkerCard.from_info(AgentInfo(name="x", backend="host", metadata=b""))


# -- scheduler side ---------------------------------------------------------------


def prefill(engine_id="p", tp=1, **kw) -> ConnectorScheduler:
    """A prefill engine's scheduler that knows its workers (made-up endpoints and agent names)."""
    sched = ConnectorScheduler(config(engine_id, tp, **kw))
    sched.set_worker_endpoints({r: f"tcp://127.0.0.1:{7000 + r}" for r in range(tp)},
                               {r: f"{engine_id}-tp{r}-abc" for r in range(tp)})
    return sched


def prefill_params(block_ids, req_id="p-req", tokens=None, **kw):
    p = prefill("p", **kw)
    req = EngineRequest(req_id, len(block_ids) * 4, {"do_remote_decode": True}, tokens)
    return p, p.request_finished(req, block_ids)


def test_prefill_holds_whole_blocks_and_returns_where_to_read():
    sched = prefill("p", abort_request_timeout=30)
    req = EngineRequest("r", 10, {"do_remote_decode": True})  # 2 whole blocks + 2 tokens
    before = time.time()
    delay, params = sched.request_finished(req, [7, 8, 9])
    assert delay is True
    assert params["remote_block_ids"] == [7, 8] and params["remote_request_id"] == "r"
    assert params["remote_endpoints"] == ["tcp://127.0.0.1:7000"] and params["do_remote_prefill"]
    meta = sched.build_connector_meta()
    assert list(meta.reqs_to_send) == ["r"] and before + 30 <= meta.reqs_to_send["r"] <= time.time() + 30
    assert not sched.build_connector_meta()  # handed over once


KEY = "k" * 32


@pytest.mark.parametrize("change", [
    {"remote_block_ids": [20, 21, 99]},  # a block the prefill engine did not hand out
    {"remote_request_id": "someone-elses"},
    {"remote_endpoints": ["tcp://10.9.9.9:7000"]},
    {"expires_at": 2e9},
    {"kvt_mac": None},
    {"kvt_mac": "00" * 32},
    {"prompt_digest": None},  # unbound from its prompt
    {"prompt_digest": "0" * 32},
])
def test_with_auth_key_decode_reads_only_params_the_prefill_engine_signed(monkeypatch, change):
    monkeypatch.setenv("KVT_AUTH_KEY", KEY)
    prompt = list(range(12))
    _, (_, params) = prefill_params([20, 21, 22], tokens=prompt)
    assert len(params["kvt_mac"]) == 64
    sched = ConnectorScheduler(config("d"))
    good = EngineRequest("good", 12, dict(params), prompt)
    assert sched.get_num_new_matched_tokens(good, 0) == (12, True)
    sched.update_state_after_alloc(good, [5, 6, 7], 12)
    assert sched.build_connector_meta().reqs_to_recv["good"].remote.block_ids == [20, 21, 22]
    forged = EngineRequest("forged", 12, {**params, **change}, prompt)
    with pytest.raises(InvalidArgument, match="kvt_mac"):
        sched.get_num_new_matched_tokens(forged, 0)
    # ended before it was scheduled: nobody is told anything on its say-so either
    assert sched.request_finished(forged, [], aborted=True) == (False, None)
    assert not sched.build_connector_meta()


@pytest.mark.parametrize("key", [None, KEY])
def test_params_handed_off_for_one_prompt_do_not_load_another(monkeypatch, key):
    """A client that got params for prompt A (any user of the prefill engine
    can) and sent them with prompt B used to fill B's blocks with A's KV, and
    the decode engine's prefix cache then served them to others asking B."""
    if key:
        monkeypatch.setenv("KVT_AUTH_KEY", key)
    a, b = list(range(100, 112)), list(range(200, 212))
    _, params = prefill("p").request_finished(
        EngineRequest("p-req", 12, {"do_remote_decode": True}, a), [20, 21, 22])
    assert len(params["prompt_digest"]) == 32
    sched = ConnectorScheduler(config("d"))
    assert sched.get_num_new_matched_tokens(EngineRequest("good", 12, dict(params), a), 0) == (12, True)
    other = EngineRequest("other", 12, dict(params), b)
    with pytest.raises(InvalidArgument, match="handed off for another prompt"):
        sched.get_num_new_matched_tokens(other, 0)
    assert sched.request_finished(other, [], aborted=True) == (False, None)
    assert not sched.build_connector_meta().reqs_to_recv  # nobody told to free on its say-so
    no_tokens = EngineRequest("embeds", 12, dict(params))  # prompt embeddings: no token ids
    with pytest.raises(InvalidArgument, match="handed off for another prompt"):
        sched.get_num_new_matched_tokens(no_tokens, 0)


@pytest.mark.parametrize("key", [None, KEY])
def test_params_that_name_no_prompt_load_only_requests_without_one(monkeypatch, caplog, key):
    """A prefill engine whose requests carry no prompt_token_ids hands off
    params that name no prompt: decode requests with token ids used to load
    them whatever their prompt, the prompt check off without anyone seeing."""
    if key:
        monkeypatch.setenv("KVT_AUTH_KEY", key)
    sched_p = prefill("p")
    with caplog.at_level(logging.WARNING, "kvt.connector.scheduler"):
        _, params = sched_p.request_finished(EngineRequest("p-1", 12, {"do_remote_decode": True}), [20, 21, 22])
        sched_p.request_finished(EngineRequest("p-2", 12, {"do_remote_decode": True}), [23, 24, 25])
    assert params.get("prompt_digest") is None
    assert sum("no prompt_token_ids" in r.getMessage() for r in caplog.records) == 1  # logged once
    sched = ConnectorScheduler(config("d"))
    with pytest.raises(InvalidArgument, match="name no prompt"):
        sched.get_num_new_matched_tokens(EngineRequest("tokens", 12, dict(params), list(range(12))), 0)
    assert sched.get_num_new_matched_tokens(EngineRequest("embeds", 12, dict(params)), 0) == (12, True)


def test_scheduler_misuse_raises_invalid_argument():
    _, (_, params) = prefill_params([20, 21, 22])
    sched = ConnectorScheduler(config("d"))
    req = EngineRequest("r", 12, dict(params))
    calls = [lambda: sched.get_num_new_matched_tokens(req, "0"),
             lambda: sched.get_num_new_matched_tokens(EngineRequest("n", None, dict(params)), 0),
             lambda: sched.update_state_after_alloc(req, None, 12),
             lambda: sched.update_state_after_alloc(req, [1, 2, 3], "12"),
             lambda: prefill("p").request_finished(EngineRequest("p", 12, {"do_remote_decode": True}), None),
             lambda: prefill("p").set_worker_endpoints(["tcp://127.0.0.1:7000"], ["p-tp0-abc"])]
    for call in calls:
        with pytest.raises(InvalidArgument):
            call()
    wide = ConnectorScheduler(ConnectorConfig(engine_id="w", kv=msgspec.structs.replace(SPEC, num_kv_heads=12),
                                              tp_size=12))
    wide.set_worker_endpoints({r: f"tcp://h:{7000 + r}" for r in range(12)}, {r: f"w{r}" for r in range(12)})
    assert wide._agents[10] == "w10" and wide._endpoints[2] == "tcp://h:7002"  # in rank order past 9 too


def test_auth_key_on_one_side_only(monkeypatch):
    _, (_, unsigned) = prefill_params([20, 21])
    monkeypatch.setenv("KVT_AUTH_KEY", KEY)
    with pytest.raises(InvalidArgument, match="no kvt_mac .* same auth_key"):
        ConnectorScheduler(config("d")).get_num_new_matched_tokens(EngineRequest("r", 8, unsigned), 0)
    _, (_, signed) = prefill_params([20, 21])
    monkeypatch.setenv("KVT_AUTH_KEY", "o" * 32)
    with pytest.raises(InvalidArgument, match="another auth_key"):
        ConnectorScheduler(config("d")).get_num_new_matched_tokens(EngineRequest("r", 8, signed), 0)
    monkeypatch.delenv("KVT_AUTH_KEY")  # a decode engine without a key does not check
    assert ConnectorScheduler(config("d")).get_num_new_matched_tokens(EngineRequest("r", 8, signed), 0) == (8, True)


def _count_parses(monkeypatch) -> list:
    calls = []
    parse = TransferParams.parse.__func__
    monkeypatch.setattr(TransferParams, "parse", classmethod(lambda cls, p: calls.append(1) or parse(cls, p)))
    return calls


def test_a_waiting_requests_params_are_parsed_and_checked_once(monkeypatch):
    # vLLM asks get_num_new_matched_tokens every step a request waits for blocks
    monkeypatch.setenv("KVT_AUTH_KEY", KEY)
    _, (_, params) = prefill_params([20, 21, 22])
    _, (_, other) = prefill_params([30, 31, 32], "p-other")
    sched = ConnectorScheduler(config("d"))
    calls = _count_parses(monkeypatch)
    req = EngineRequest("waits", 12, dict(params))
    for _ in range(5):
        assert sched.get_num_new_matched_tokens(req, 0) == (12, True)
    sched.update_state_after_alloc(req, [5, 6, 7], 12)
    assert len(calls) == 1
    assert sched.build_connector_meta().reqs_to_recv["waits"].remote.block_ids == [20, 21, 22]
    # vLLM asks once more after the load: do_remote_prefill is cleared, nothing to load, nothing parsed
    assert sched.get_num_new_matched_tokens(req, 12) == (0, False)
    assert len(calls) == 1
    # and a request that ends while waiting tells the prefill side from the same check
    waiting = EngineRequest("gives-up", 12, dict(other))
    sched.get_num_new_matched_tokens(waiting, 0)
    assert sched.request_finished(waiting, [], aborted=True) == (False, None)
    assert len(calls) == 2 and sched.build_connector_meta().reqs_to_recv["gives-up"].local_block_ids == []
    # but a prefill request's params are parsed: malformed ones are refused before the hand-off
    with pytest.raises(InvalidArgument, match="malformed"):
        sched.get_num_new_matched_tokens(EngineRequest("p", 12, {"do_remote_decode": True, "tp_size": "many"}), 0)


@pytest.mark.parametrize("change", [
    lambda p: p.__setitem__("remote_block_ids", [20, 21, 99]),      # a new list
    lambda p: p.__setitem__("remote_request_id", "someone-elses"),  # a new value
    lambda p: p.pop("kvt_mac"),                                     # a key gone
], ids=["new-list", "new-value", "key-gone"])
def test_params_changed_while_waiting_are_checked_again(monkeypatch, change):
    monkeypatch.setenv("KVT_AUTH_KEY", KEY)
    _, (_, params) = prefill_params([20, 21, 22])
    sched = ConnectorScheduler(config("d"))
    req = EngineRequest("r", 12, dict(params))
    assert sched.get_num_new_matched_tokens(req, 0) == (12, True)
    change(req.kv_transfer_params)
    with pytest.raises(InvalidArgument, match="kvt_mac"):
        sched.get_num_new_matched_tokens(req, 0)
    req.kv_transfer_params = dict(params)  # a new dict with the signed values passes again
    assert sched.get_num_new_matched_tokens(req, 0) == (12, True)


def test_params_used_meanwhile_by_another_request_are_refused_on_the_next_ask():
    _, (_, params) = prefill_params([20, 21, 22])
    sched = ConnectorScheduler(config("d"))
    first, second = EngineRequest("first", 12, dict(params)), EngineRequest("second", 12, dict(params))
    assert sched.get_num_new_matched_tokens(second, 0) == (12, True)  # checked and remembered
    sched.update_state_after_alloc(first, [1, 2, 3], sched.get_num_new_matched_tokens(first, 0)[0])
    with pytest.raises(InvalidArgument, match="used already, by request 'first'"):
        sched.get_num_new_matched_tokens(second, 0)


def test_remembered_checks_are_bounded(monkeypatch):
    from kvt.connector.scheduler import _Checked

    monkeypatch.setattr(_Checked, "MAX", 4)
    _, (_, params) = prefill_params([20, 21, 22])
    _, (_, other) = prefill_params([30, 31, 32], "p-other")
    sched = ConnectorScheduler(config("d"))
    calls = _count_parses(monkeypatch)
    reqs = [EngineRequest(f"r{i}", 12, dict(params)) for i in range(6)]
    for r in reqs:
        sched.get_num_new_matched_tokens(r, 0)
    assert len(sched._checked._by) == 4
    sched.get_num_new_matched_tokens(reqs[-1], 0)  # kept
    sched.get_num_new_matched_tokens(reqs[0], 0)   # dropped: parsed again
    assert len(calls) == 7


def test_prefill_frees_short_and_aborted_requests_at_once():
    sched = prefill("p")
    delay, params = sched.request_finished(EngineRequest("short", 3, {"do_remote_decode": True}), [1])
    assert delay is False and params["do_remote_prefill"] and not params.get("remote_block_ids")
    assert sched.request_finished(EngineRequest("ab", 30, {"do_remote_decode": True}), [1, 2], aborted=True) == (
        False, None)
    assert sched.request_finished(EngineRequest("plain", 30, None), [1]) == (False, None)
    assert not sched.build_connector_meta()


@pytest.mark.parametrize("port", [0, 7000])
def test_prefill_needs_its_workers_endpoints_and_names(port):
    """Also with a fixed side_channel_port: params without the workers'
    agent names were read from a restart of the engine on the same port
    (other contents, same block ids) and reported loaded."""
    sched = ConnectorScheduler(config("p", side_channel_port=port))
    with pytest.raises(InvalidArgument, match="set_worker_endpoints"):
        sched.request_finished(EngineRequest("r", 8, {"do_remote_decode": True}), [1, 2])
    with pytest.raises(InvalidArgument, match="one endpoint and one agent name per rank"):
        sched.set_worker_endpoints({1: "tcp://x:1"}, {1: "p-tp1-abc"})
    sched.set_worker_endpoints({0: "tcp://x:1"}, {0: "p-tp0-abc"})
    assert sched.request_finished(EngineRequest("r", 8, {"do_remote_decode": True}), [1, 2])[0]


def test_prefill_params_name_its_workers_agents_under_the_tag(monkeypatch):
    monkeypatch.setenv("KVT_AUTH_KEY", KEY)
    sched = ConnectorScheduler(config("p"))
    with pytest.raises(InvalidArgument, match="one agent name per rank"):
        sched.set_worker_endpoints({0: "tcp://x:1"}, {1: "p-tp1-abc"})
    with pytest.raises(InvalidArgument, match="agent names"):
        sched.set_worker_endpoints({0: "tcp://x:1"}, {0: ""})
    with pytest.raises(InvalidArgument, match="agent names"):
        sched.set_worker_endpoints({0: "tcp://x:1"}, {0: "p" * 257})
    sched.set_worker_endpoints({0: "tcp://x:1"}, {0: "p-tp0-abc"})
    _, params = sched.request_finished(EngineRequest("r", 8, {"do_remote_decode": True}), [1, 2])
    assert params["remote_agents"] == ["p-tp0-abc"]
    secret = Secret(KEY)
    assert TransferParams.parse(params).source_problem(secret) is None
    forged = TransferParams.parse({**params, "remote_agents": ["p-tp0-xyz"]})
    assert "kvt_mac" in forged.source_problem(secret)  # the names are under the tag
    assert "remote_agents" in TransferParams.parse({**params, "remote_agents": ["a", "b"]}).source_problem()


def test_decode_schedules_one_read_pairing_blocks_in_token_order():
    _, (_, params) = prefill_params([20, 21, 22, 23])
    sched = ConnectorScheduler(config("d"))
    req = EngineRequest("d-req", 15, dict(params))  # 3 whole blocks: the prefill side offers 4
    assert sched.get_num_new_matched_tokens(req, 0) == (12, True)
    assert sched.get_num_new_matched_tokens(req, 0) == (12, True)  # no side effects
    sched.update_state_after_alloc(req, [5, 6, 7, 8], 12)
    assert req.kv_transfer_params["do_remote_prefill"] is False
    recv = sched.build_connector_meta().reqs_to_recv["d-req"]
    assert recv.local_block_ids == [5, 6, 7] and recv.remote.block_ids == [20, 21, 22]
    assert recv.remote.engine_id == "p" and recv.remote.request_id == "p-req"
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # one transfer per request
    # while loading, its blocks must outlive an abort
    assert sched.request_finished(req, [5, 6, 7, 8], aborted=True) == (True, None)
    sched.update_connector_output(set(), {"d-req"})
    assert sched.request_finished(req, [5, 6, 7, 8]) == (False, None)
    assert not any(sched.outstanding().values()), sched.outstanding()


def test_decode_prefix_hits():
    _, (_, params) = prefill_params([20, 21, 22, 23])
    sched = ConnectorScheduler(config("d"))
    partial = EngineRequest("partial", 16, dict(params))
    n, _ = sched.get_num_new_matched_tokens(partial, 4)  # first block cached here
    sched.update_state_after_alloc(partial, [5, 6, 7, 8], n)
    full = EngineRequest("full", 16, dict(prefill_params([20, 21, 22, 23], "p-req-2")[1][1]))
    assert sched.get_num_new_matched_tokens(full, 16) == (0, False)
    sched.update_state_after_alloc(full, [1, 2, 3, 4], 0)
    meta = sched.build_connector_meta().reqs_to_recv
    assert (meta["partial"].local_block_ids, meta["partial"].remote.block_ids) == ([6, 7, 8], [21, 22, 23])
    # a full hit only tells the prefill side it may free
    assert (meta["full"].local_block_ids, meta["full"].remote.block_ids) == ([], [])


def test_nothing_to_load_needs_no_blocks():
    """vLLM computes a request itself (prompt_logprobs) and allocates its
    long prompt chunk by chunk: fewer blocks than the prefill side offers,
    nothing to load.  Only the notification that frees the prefill side."""
    _, (_, params) = prefill_params([20, 21, 22, 23])
    sched = ConnectorScheduler(config("d"))
    req = EngineRequest("chunked", 16, dict(params))
    sched.update_state_after_alloc(req, [1, 2], 0)
    recv = sched.build_connector_meta().reqs_to_recv["chunked"]
    assert (recv.local_block_ids, recv.remote.block_ids) == ([], [])
    assert req.kv_transfer_params["do_remote_prefill"] is False


def test_params_are_used_once():
    """A second request with the same params (a retry, a replay) is refused:
    the prefill engine frees the blocks after the first read or release."""
    _, (_, params) = prefill_params([20, 21])
    sched = ConnectorScheduler(config("d"))
    first = EngineRequest("first", 8, dict(params))
    sched.update_state_after_alloc(first, [5, 6], sched.get_num_new_matched_tokens(first, 0)[0])
    assert list(sched.build_connector_meta().reqs_to_recv) == ["first"]
    again = EngineRequest("again", 8, dict(params))
    with pytest.raises(InvalidArgument, match="used already, by request 'first'"):
        sched.get_num_new_matched_tokens(again, 0)
    assert sched.request_finished(again, [], aborted=True) == (False, None)  # no second notification
    # released without a read (ended before it was scheduled) counts as used too
    _, (_, released) = prefill_params([30], "p-req-2")
    assert sched.request_finished(EngineRequest("gone", 4, dict(released)), [], aborted=True) == (False, None)
    assert list(sched.build_connector_meta().reqs_to_recv) == ["gone"]
    with pytest.raises(InvalidArgument, match="used already, by request 'gone'"):
        sched.get_num_new_matched_tokens(EngineRequest("retry", 4, dict(released)), 0)


def test_spent_params_are_forgotten_when_their_lease_ends_and_bounded(monkeypatch):
    monkeypatch.setattr(_Spent, "MAX", 2)
    spent, now = _Spent(), time.time()
    spent.add(("p", "over"), now - 1, "a")
    assert spent.user(("p", "over")) is None  # the prefill engine refuses it by then anyway
    for i in range(3):
        spent.add(("p", str(i)), now + 60, f"d{i}")
    assert [spent.user(("p", str(i))) for i in range(3)] == [None, "d1", "d2"]
    assert len(spent._by) == 2


def test_decode_request_ended_before_scheduling_lets_prefill_free():
    _, (_, params) = prefill_params([20, 21])
    sched = ConnectorScheduler(config("d"))
    assert sched.request_finished(EngineRequest("gone", 8, dict(params)), [], aborted=True) == (False, None)
    recv = sched.build_connector_meta().reqs_to_recv["gone"]
    assert recv.local_block_ids == [] and recv.remote.request_id == "p-req"


def test_short_prompt_schedules_nothing_on_decode():
    _, params = prefill("p").request_finished(EngineRequest("short", 3, {"do_remote_decode": True}), [9])
    sched = ConnectorScheduler(config("d"))
    req = EngineRequest("short", 3, params)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, [1], 0)
    assert sched.request_finished(req, [1]) == (False, None)
    assert not sched.build_connector_meta()  # no read, no notification: nothing is held for it


def test_malformed_params_raise_and_leave_state_alone():
    sched = ConnectorScheduler(config("d"))
    req = EngineRequest("x", 8, {"do_remote_prefill": True, "remote_block_ids": [1, 2]})  # no engine/endpoints
    with pytest.raises(InvalidArgument, match="remote_engine_id"):
        sched.get_num_new_matched_tokens(req, 0)
    with pytest.raises(InvalidArgument):
        sched.update_state_after_alloc(req, [1, 2], 8)
    assert req.kv_transfer_params["do_remote_prefill"] is True
    assert not sched.build_connector_meta()


@pytest.mark.parametrize("tp_size, decode_tp, why", [
    (3, 2, "do not divide"),      # neither a multiple of the other
    (16, 1, "8 KV heads"),        # more prefill ranks than heads: another model, or a lie
    (2, 4, None), (8, 1, None),   # heterogeneous TP that works
])
def test_a_prefill_tp_size_that_cannot_fit_is_refused_before_any_handshake(tp_size, decode_tp, why):
    sched = ConnectorScheduler(config("d", decode_tp))
    req = EngineRequest("x", 8, {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r",
                                 "remote_block_ids": [1, 2], "remote_host": "127.0.0.1", "remote_port": 7000,
                                 "tp_size": tp_size})
    if why is None:
        assert sched.get_num_new_matched_tokens(req, 0) == (8, True)
        return
    with pytest.raises(InvalidArgument, match=why):
        sched.get_num_new_matched_tokens(req, 0)
    assert not sched.build_connector_meta()


def test_a_kv_consumer_holds_no_blocks_for_a_do_remote_decode_request(caplog):
    sched = ConnectorScheduler(config("d", side_channel_port=7000, kv_role="kv_consumer", kv_buffer_device="cpu"))
    req = EngineRequest("r", 30, {"do_remote_decode": True})
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, [3, 4], 0)
    assert "kv_role is kv_consumer" in caplog.text and req.kv_transfer_params["do_remote_decode"] is False
    assert sched.request_finished(req, [3, 4]) == (False, None)  # freed now, not after abort_request_timeout
    meta = sched.build_connector_meta()
    assert not meta.reqs_to_send and not meta.reqs_to_save  # nothing held, nothing staged


def test_a_kv_producer_refuses_to_load():
    sched = ConnectorScheduler(config("p", kv_role="kv_producer"))
    req = EngineRequest("x", 8, {"do_remote_prefill": True, "remote_engine_id": "d", "remote_request_id": "r",
                                 "remote_block_ids": [1, 2], "remote_host": "127.0.0.1", "remote_port": 7000})
    with pytest.raises(InvalidArgument, match="kv_producer"):
        sched.get_num_new_matched_tokens(req, 0)
    assert not sched.build_connector_meta()


def test_prefill_staging_copies_the_blocks_each_step_fills():
    sched = prefill("p", kv_buffer_device="cpu")
    req = EngineRequest("r", 30, {"do_remote_decode": True})
    sched.update_state_after_alloc(req, [3, 4], 0)
    assert sched.build_connector_meta().reqs_to_save == {"r": [3, 4]}
    # chunked prefill: the next chunk fills the rest of block 4 and new blocks 9, 2
    sched.update_state_after_alloc(req, [3, 4, 9, 2], 0)
    assert sched.build_connector_meta().reqs_to_save == {"r": [4, 9, 2]}
    sched.request_finished(req, [3, 4, 9, 2])
    assert sched.outstanding()["saving"] == 0
    # preempted and resumed: new blocks from the first that differs (3 is a prefix-cache hit)
    sched.update_state_after_alloc(req, [3, 4, 9, 2], 0)
    sched.update_state_after_alloc(req, [3, 7, 8], 0)
    assert sched.build_connector_meta().reqs_to_save == {"r": [7, 8]}
    sched.update_state_after_alloc(req, [5, 6], 0)
    assert sched.build_connector_meta().reqs_to_save == {"r": [5, 6]}
    unstaged = prefill("p")
    unstaged.update_state_after_alloc(req, [3, 4], 0)
    assert unstaged.build_connector_meta().reqs_to_save == {}


def test_finished_aggregator_waits_for_every_worker():
    agg = FinishedAggregator(2)
    assert agg.update([({"a"}, {"b"}), ({"a"}, set())]) == ({"a"}, set())
    assert len(agg) == 1
    assert agg.update([(set(), {"b"})]) == (set(), {"b"}) and len(agg) == 0


def test_descriptors_for_100k_blocks():
    lay = part_layout(BlockLayout(base_addrs=list(range(0, 8 * 10**8, 10**8)), block_len=512,
                                  num_blocks=100_000, stride=512), parts=2, sl=Slice(0, 256))
    descs = lay.descs()
    assert len(descs) == 16 * 100_000 and descs.array[-1, 0] == 7 * 10**8 + 256 + 99_999 * 512
    assert np.all(descs.lengths == 256)
