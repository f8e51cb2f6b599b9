"""Regressions from the audit of tensor-parallel read planning, cache layouts
and host staging.  ``pd`` runs a prefill and a decode engine in one process
(every TP rank a ``ConnectorWorker`` on the host backend) and checks every
byte each decode rank holds against the prefill ranks' caches, so dtypes the
reference engine's toy model cannot hold (fp8, int8) are covered too.  Every
wait is bounded."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvt import memory
from kvt.connector import ConnectorConfig, ConnectorScheduler, ConnectorWorker, EngineRequest, KVCacheSpec
from kvt.connector.staging import HostStaging, copy_blocks

pytestmark = pytest.mark.timeout(120)

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-size views: compare bits


def spec(layout="split", heads=4, dtype="float16", block_size=2, head_layout="HND", head_dim=4):
    return KVCacheSpec(num_layers=2, num_kv_heads=1 if layout == "mla" else heads, head_dim=head_dim, dtype=dtype,
                       block_size=block_size, kv_layout=layout, head_layout=head_layout)


def make_caches(kv: KVCacheSpec, tp: int, blocks: int, private: bool, seed: int | None):
    """One rank's caches, random bits (``seed``) or zeros; ``private``: plain
    torch memory (what staging puts behind host buffers)."""
    block = kv.block_shape(tp)
    shape = {"split": (2, blocks, *block), "joined": (blocks, 2, *block)}.get(kv.kv_layout, (blocks, *block))
    dtype = getattr(torch, kv.dtype)
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    out = {}
    for i in range(kv.num_layers):
        t = torch.zeros(shape, dtype=dtype) if private else memory.empty_tensor(shape, dtype).zero_()
        if gen is not None:
            bits = t.view(_INT[t.element_size()])
            bits.copy_(torch.randint(-128 if bits.is_signed() else 0, 127, shape, generator=gen, dtype=bits.dtype))
        out[f"layers.{i}"] = t
    return out


def canonical(t, kv: KVCacheSpec):
    """A layer's cache as bits, ``(blocks, parts, heads, block_size, content)``."""
    t = t.view(_INT[t.element_size()])
    if kv.kv_layout == "mla":
        return t[:, None, None]
    v = {"split": t.transpose(0, 1), "joined": t, "packed": t[:, None]}[kv.kv_layout]
    return v.transpose(2, 3) if kv.head_layout == "NHD" else v


def pd(kv: KVCacheSpec, ptp=1, dtp=1, *, pstaging=False, dstaging=False, pblocks=8, dblocks=8,
       prompt_len=None, remote_ids=(5, 0, 3), local_ids=(1, 6, 2), decode_kv=None, override=None, timeout=30.0):
    """One request prefill -> decode (``decode_kv``: another spec for the
    decode engine; ``override``: what a router changes in the params).
    Returns each decode rank's failed blocks and failure reasons; when none
    failed, every loaded byte has been checked (and that no other block was
    written), else that nothing was written."""
    prompt_len = prompt_len or len(remote_ids) * kv.block_size
    specs = {"p": kv, "d": decode_kv or kv}

    def cfg(engine_id, tp, staging):
        return ConnectorConfig(engine_id=engine_id, kv=specs[engine_id], tp_size=tp, backend="host",
                               kv_buffer_device="cpu" if staging else None, handshake_timeout=5.0)

    made = []
    try:
        pws = [ConnectorWorker(cfg("p", ptp, pstaging), r) for r in range(ptp)]
        made += pws
        dws = [ConnectorWorker(cfg("d", dtp, dstaging), r) for r in range(dtp)]
        made += dws
        # MLA is replicated: every prefill rank holds the same latent cache
        pkv = [make_caches(kv, ptp, pblocks, pstaging, 7 if kv.mla else 7 + r) for r in range(ptp)]
        dkv = [make_caches(specs["d"], dtp, dblocks, dstaging, None) for _ in range(dtp)]
        psched = ConnectorScheduler(cfg("p", ptp, pstaging))
        psched.set_worker_endpoints({r: w.register_kv_caches(c) for r, (w, c) in enumerate(zip(pws, pkv))},
                                    {r: w.agent.name for r, w in enumerate(pws)})
        for w, c in zip(dws, dkv):
            w.register_kv_caches(c)
        # prefill: allocate (staging schedules the save), compute, finish, hold
        req = EngineRequest("req", prompt_len, {"do_remote_decode": True})
        psched.update_state_after_alloc(req, list(remote_ids), 0)
        meta = psched.build_connector_meta()
        for w in pws:
            w.start_load_kv(meta)
            w.wait_for_save()
        delay, params = psched.request_finished(req, list(remote_ids))
        assert delay
        meta = psched.build_connector_meta()
        for w in pws:
            w.start_load_kv(meta)
        # decode: match, allocate, read
        dsched = ConnectorScheduler(cfg("d", dtp, dstaging))
        dreq = EngineRequest("d-req", prompt_len, {**params, **(override or {})})
        n, _ = dsched.get_num_new_matched_tokens(dreq, 0)
        dsched.update_state_after_alloc(dreq, list(local_ids), n)
        meta = dsched.build_connector_meta()
        for w in dws:
            w.start_load_kv(meta)
        recv, sent, errors = [False] * dtp, [False] * ptp, [set() for _ in range(dtp)]
        deadline = time.monotonic() + timeout
        while not (all(recv) and (all(sent) or any(errors))):  # a refused handshake never reaches the prefill
            assert time.monotonic() < deadline, f"not settled: received {recv}, released {sent}"
            for r, w in enumerate(dws):
                recv[r] |= "d-req" in w.get_finished()[1]
                errors[r] |= w.get_block_ids_with_load_errors()
            for r, w in enumerate(pws):
                sent[r] |= "req" in w.get_finished()[0]
            time.sleep(0.002)
        if any(errors):
            assert not any(canonical(t, specs["d"]).any() for c in dkv for t in c.values()), "a failed read wrote"
            return errors, [w.failure_reasons().get("d-req", "") for w in dws]
        loaded = min(prompt_len // kv.block_size, len(remote_ids))
        rids, lids = list(remote_ids[:loaded]), list(local_ids[:loaded])
        others = [b for b in range(dblocks) if b not in lids]
        for name in pkv[0]:
            # every head of the model, in rank order
            full = torch.cat([canonical(c[name], kv) for c in pkv], dim=2) if not kv.mla else canonical(pkv[0][name], kv)
            for r in range(dtp):
                got = canonical(dkv[r][name], specs["d"])
                h = got.shape[2]
                want = full[rids] if kv.mla else full[rids][:, :, r * h:(r + 1) * h]
                assert torch.equal(got[lids], want), f"{name}: decode rank {r} got wrong bytes"
                assert not got[others].any(), f"{name}: decode rank {r}: blocks outside the request written"
        return errors, []
    finally:
        for w in made:
            w.shutdown()


# -- 1: staging copies bits, whatever the dtype ------------------------------------


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_copy_blocks_moves_fp8_blocks(dtype):
    """torch has no index_copy_ for fp8 on CPU: staging an fp8 cache raised
    NotImplementedError out of wait_for_save."""
    src = [torch.randint(0, 255, (6, 2, 3), dtype=torch.uint8).view(getattr(torch, dtype)) for _ in range(2)]
    dst = [torch.zeros(6, 2, 3, dtype=getattr(torch, dtype)) for _ in range(2)]
    copy_blocks(src, dst, np.asarray([4, 1], np.int64), "d2h")
    for s, d in zip(src, dst):
        bits_s, bits_d = s.view(torch.uint8), d.view(torch.uint8)
        assert torch.equal(bits_d[[1, 4]], bits_s[[1, 4]]) and not bits_d[[0, 2, 3, 5]].any()


def test_host_staging_copies_non_contiguous_fp8_device_buffers():
    """Device buffers need not be contiguous (only the host mirrors are
    registered): K and V as strided views of one fp8 tensor."""
    kv = torch.randint(0, 255, (6, 2, 4, 3), dtype=torch.uint8).view(torch.float8_e4m3fn)
    staging = HostStaging([kv[:, 0], kv[:, 1]])
    staging.save([2, 5])
    for part, h in enumerate(staging.host):
        assert torch.equal(h.view(torch.uint8)[[2, 5]], kv.view(torch.uint8)[[2, 5], part])
        h.view(torch.uint8)[0] = 9
    staging.load([0])
    assert (kv.view(torch.uint8)[0] == 9).all()


@pytest.mark.parametrize("dtype, ptp, dtp", [("float8_e4m3fn", 1, 2), ("float8_e5m2", 2, 1), ("int8", 2, 2),
                                             ("uint8", 1, 1)])
def test_staged_one_byte_caches_arrive_bit_exact(dtype, ptp, dtp):
    errors, why = pd(spec(dtype=dtype), ptp, dtp, pstaging=True, dstaging=True)
    assert not any(errors), why


# -- 2: combinations the engine tests do not run -----------------------------------


@pytest.mark.parametrize("layout, head_layout, ptp, dtp, pstaging, dstaging, block_size", [
    ("packed", "HND", 1, 4, True, False, 2),
    ("packed", "HND", 4, 2, False, True, 1),
    ("joined", "HND", 4, 1, True, True, 3),
    ("split", "HND", 2, 4, True, True, 1),
    ("joined", "NHD", 2, 2, True, True, 2),
    ("packed", "NHD", 2, 2, False, True, 1),
    ("mla", "HND", 4, 2, True, True, 2),
    ("mla", "HND", 1, 4, False, True, 1),
    ("mla", "NHD", 2, 1, True, False, 3),
])
def test_layouts_tp_and_staging_deliver_every_byte(layout, head_layout, ptp, dtp, pstaging, dstaging, block_size):
    """Pools of different sizes on the two sides, and a prompt ending mid-block
    (its last, partial block is not read)."""
    kv = spec(layout, head_layout=head_layout, block_size=block_size)
    errors, why = pd(kv, ptp, dtp, pstaging=pstaging, dstaging=dstaging, pblocks=6, dblocks=9,
                     prompt_len=3 * block_size - (block_size > 1))
    assert not any(errors), why


@pytest.mark.parametrize("ptp, dtp, prefill_kv, decode_kv", [
    (2, 1, spec("mla", head_layout="HND"), spec("mla", head_layout="NHD")),   # MLA blocks have no heads
    (1, 2, spec(head_layout="NHD", block_size=1), spec(head_layout="NHD", block_size=1)),  # one token a block
    (1, 4, spec(head_layout="HND"), spec(head_layout="NHD")),                # one head a decode rank
    (2, 2, spec("packed", heads=2, head_layout="NHD"), spec("packed", heads=2, head_layout="HND")),
])
def test_declared_layouts_that_differ_but_lay_bytes_out_alike_pair(ptp, dtp, prefill_kv, decode_kv):
    errors, why = pd(prefill_kv, ptp, dtp, decode_kv=decode_kv, pstaging=True, dstaging=True)
    assert not any(errors), why


# -- 3: typed refusals, nothing written ---------------------------------------------


@pytest.mark.parametrize("ptp, dtp, prefill_kv, decode_kv, reason", [
    (2, 1, spec(), spec(head_layout="NHD"), "head_layout"),
    (1, 2, spec("packed", head_layout="NHD"), spec("packed", head_layout="NHD"), "needs head_layout 'HND'"),
    (1, 1, spec(), spec(dtype="bfloat16"), "dtype"),
    (2, 2, spec(), spec("mla"), "MLA pairs only with MLA"),
    (1, 1, spec(), spec(block_size=1), "block_size"),
])
def test_incompatible_engines_are_refused(ptp, dtp, prefill_kv, decode_kv, reason):
    errors, why = pd(prefill_kv, ptp, dtp, decode_kv=decode_kv, pstaging=True, dstaging=True)
    assert errors == [{1, 6, 2}] * dtp
    assert all("IncompatiblePeer" in w and reason in w for w in why), why


@pytest.mark.parametrize("override, reason", [
    ({"remote_block_ids": [5, 0, 8]}, "out of range"),      # past the prefill pool (8 blocks)
    ({"remote_block_ids": [5, 2**62, 3]}, "out of range"),
])
def test_remote_block_ids_past_the_prefill_pool_fail_the_request(override, reason):
    errors, why = pd(spec(), 2, 1, override=override, dstaging=True)
    assert errors == [{1, 6, 2}] and all(reason in w for w in why), why


@pytest.mark.parametrize("tp_size", [0, -1, 1025, 2**40, "two", 1.5])
def test_hostile_tp_size_is_refused_before_planning(tp_size):
    from kvt.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="tp_size"):
        pd(spec(), 2, 1, override={"tp_size": tp_size})


@pytest.mark.parametrize("heads, tp", [(4, 3), (2, 4), (6, 4)])
def test_heads_not_divisible_by_tp_is_a_config_error(heads, tp):
    from kvt.errors import ConfigError

    with pytest.raises(ConfigError, match="multiple of tp_size"):
        ConnectorConfig.from_dict({"engine_id": "e", "tp_size": tp, "kv": {
            "num_layers": 1, "num_kv_heads": heads, "head_dim": 4, "dtype": "float16", "block_size": 2}})
