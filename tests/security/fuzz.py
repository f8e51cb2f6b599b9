"""Feed mutated peer bytes to one decoder; run as a subprocess by test_fuzz.py.

    python fuzz.py TARGET COUNT SEED PROGRESS_FILE

Blob ``i`` is a deterministic function of (TARGET, SEED, i), so the parent
can rebuild the blob that crashed or hung this process (its index is in
PROGRESS_FILE) and keep it under ``regressions/``.  Regression files for the
target are replayed first.  Exit 0: every blob raised only kvt errors (or was
accepted); exit 3: a non-kvt exception (printed).
"""

from __future__ import annotations

import os
import random
import sys
import traceback
from pathlib import Path

import msgspec

REGRESSIONS = Path(__file__).parent / "regressions"
EXTREME_INTS = [0, -1, 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), 2**26, 2**32, 4096, 2**64 - 4096]
WEIRD_STRS = ["", "\x00", "é" * 300, "a" * 100_000, "DRAM", "VRAM", "tcp://", "tcp://127.0.0.1:1", "/proc/self/mem"]


def _mutate_value(rng: random.Random, v):
    r = rng.random()
    if isinstance(v, bool) or v is None:
        return rng.choice([True, False, None, 0, "x"])
    if isinstance(v, int):
        return rng.choice(EXTREME_INTS) if r < 0.8 else str(v)
    if isinstance(v, str):
        return rng.choice(WEIRD_STRS) if r < 0.8 else rng.randbytes(rng.randrange(8))
    if isinstance(v, (bytes, bytearray)):
        v = bytearray(v)
        if r < 0.3 and v:
            del v[rng.randrange(len(v)):]
        elif r < 0.6 and v:
            for _ in range(rng.randrange(1, 8)):
                v[rng.randrange(len(v))] = rng.randrange(256)
        elif r < 0.8:
            v += rng.randbytes(rng.choice([1, 7, 24, 25]))
        else:
            v = bytearray(rng.choice([b"", b"\xff" * 24, (2**64 - 4096).to_bytes(8, "little") * 3]))
        return bytes(v)
    if isinstance(v, list):
        if v and r < 0.5:
            i = rng.randrange(len(v))
            v = list(v)
            v[i] = _mutate_value(rng, v[i])
            return v
        return rng.choice([[], v * rng.choice([2, 100]), [[[[]]]], [2**64 - 1] * 3])
    if isinstance(v, dict):
        v = dict(v)
        if v and r < 0.7:
            k = rng.choice(list(v))
            v[k] = _mutate_value(rng, v[k])
        elif v and r < 0.85:
            del v[rng.choice(list(v))]
        else:
            v[rng.choice(["extra", "t", "v", "zz"])] = _mutate_value(rng, 1)
        return v
    return v


def mutate(seed: bytes, rng: random.Random) -> bytes:
    """Structural mutation (decode, change a field, re-encode) or raw bytes."""
    r = rng.random()
    if r < 0.55:
        try:
            tree = msgspec.msgpack.decode(seed)
            for _ in range(rng.randrange(1, 4)):
                tree = _mutate_value(rng, tree)
            return msgspec.msgpack.encode(tree)
        except (msgspec.MsgspecError, TypeError, ValueError, OverflowError):
            pass
    b = bytearray(seed)
    for _ in range(rng.randrange(1, 6)):
        op = rng.randrange(5)
        if op == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            del b[rng.randrange(len(b)):]
        elif op == 2:
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.randbytes(rng.randrange(1, 16))
        elif op == 3 and b:
            b[rng.randrange(len(b))] = rng.choice([0xC1, 0xDC, 0xDD, 0xDF, 0xCF, 0xD3, 0x91, 0xFF])
        elif op == 4:
            b = bytearray(b"\x91" * rng.randrange(1, 300_000)) if rng.random() < 0.1 else b
    return bytes(b)


def targets():
    """name -> (seed blob, feed(blob)).  Built lazily per target."""
    import numpy as np
    from kvt import memory
    from kvt.wire import AgentInfo, BlockLayout, HandshakeReply, HandshakeRequest, decode, encode

    def wire_agent_info():
        lay = BlockLayout(base_addrs=[4096, 1 << 20], block_len=4096, num_blocks=16, stride=4096)
        seed = encode(AgentInfo(name="p", backend="host", metadata=b"\x01" * 40, layouts={"kv": lay},
                                extra={"a": [1, 2, {"b": "c"}]}))

        def feed(blob):
            info = decode(blob, AgentInfo)
            for lay in info.layouts.values():
                if lay.num_blocks * len(lay.base_addrs) <= 1 << 16:
                    lay.descs()
        return seed, feed

    def wire_handshake():
        seeds = [encode(HandshakeRequest(sender="x")), encode(HandshakeReply(payload=b"abc", error="e"))]
        # the reply seed carries every field kind; both types are tried on each blob

        def feed(blob):
            for t in (HandshakeRequest, HandshakeReply):
                try:
                    decode(blob, t)
                except Exception as e:  # noqa: BLE001 - re-raised unless a kvt error
                    _kvt_only(e)
        return seeds[1], feed

    def add_remote_of(make, options, keep=None):
        """``add_remote`` of a fresh victim, seeded with a real peer's metadata."""
        victim, peer = make("victim", options), make("peer", options)
        buf = keep if keep is not None else np.zeros(1 << 16, np.uint8)
        peer.register(buf)
        seed = peer.local_metadata()

        def feed(blob):
            try:
                name = victim.add_remote(blob)
            except Exception as e:  # noqa: BLE001
                _kvt_only(e)
                return
            victim.remove_remote(name)
        feed.keep = (victim, peer, buf)
        return seed, feed

    def host_add_remote():
        from kvt_host.backend import HostBackend
        return add_remote_of(HostBackend, {"timeout": 2}, memory.empty(1 << 16))

    def host_server():
        import zmq
        from kvt_host.backend import HostBackend
        from kvt_host.protocol import Request
        owner = HostBackend("owner", {"timeout": 2})
        guard = np.full(3 << 16, 0xA5, np.uint8)
        region = guard[1 << 16: 2 << 16]
        owner.register(region)
        rows = np.array([[region.ctypes.data, 4096, 0]], np.uint64).tobytes()
        seed = encode(Request(id=1, sender="a", op="WRITE", rows=rows))

        def feed(blob):
            serve = getattr(owner._server, "_answer", owner._server._handle)  # (older kvt: _handle)
            reply = serve([zmq.Frame(blob), zmq.Frame(b"\x00" * 4096)])
            assert reply is None or isinstance(reply, list)
            assert (guard[: 1 << 16] == 0xA5).all() and (guard[2 << 16:] == 0xA5).all(), "guard bytes changed"
        feed.keep = (owner, guard)
        return seed, feed

    def nixl_add_remote():
        from kvt_nixl.backend import NixlBackend
        return add_remote_of(NixlBackend, {})

    def nixl_record(pick, head=0):
        """A live peer's NIXL blob with one record's value (after ``head`` bytes kept)
        replaced by the blob; ``pick(tag, value)`` chooses the first such record."""
        from kvt_nixl.backend import NixlBackend
        from kvt_nixl.metadata import NixlMetadata, _blob, _records
        seed_md, feed_md = add_remote_of(NixlBackend, {})
        md = decode(seed_md, NixlMetadata)
        records = _records(md.nixl, md.name)
        d = next(i for i, (t, v) in enumerate(records) if pick(t, v))

        def feed(value):
            forged = records[:d] + [(records[d][0], records[d][1][:head] + value)] + records[d + 1:]
            feed_md(encode(msgspec.structs.replace(md, nixl=_blob(forged))))
        feed.keep = feed_md.keep
        return records[d][1][head:], feed

    def nixl_rkey():
        """The first UCX remote key (UCX unpacks keys inside add_remote_agent; a
        forged memory type segfaulted it)."""
        return nixl_record(lambda t, v: t == b"" and len(v) > 24, head=24)

    def nixl_address():
        """The first connection record: a UCX worker address, which NIXL connects to
        inside add_remote_agent."""
        return nixl_record(lambda t, v: t == b"c" and len(v) > 0)

    def kv_transfer_params():
        """A prefill engine's signed params, mutated, through a decode engine's
        scheduler, with and without a key (a client of the decode engine sends
        them; the blob is their msgpack form of the JSON object)."""
        from kvt.connector import ConnectorConfig, ConnectorScheduler, EngineRequest, KVCacheSpec
        spec = KVCacheSpec(model="m", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_size=4)

        def scheduler(engine_id, key=None, **kw):
            os.environ.pop("KVT_AUTH_KEY", None)
            if key:
                os.environ["KVT_AUTH_KEY"] = key
            try:
                return ConnectorScheduler(ConnectorConfig(engine_id=engine_id, kv=spec, **kw))
            finally:
                os.environ.pop("KVT_AUTH_KEY", None)
        key = "fuzz-" + "k" * 32
        prefill = scheduler("p", key)
        prefill.set_worker_endpoints({0: "tcp://127.0.0.1:7000"}, {0: "p-tp0-abc"})
        _, params = prefill.request_finished(EngineRequest("p-req", 16, {"do_remote_decode": True}), [3, 4, 5, 6])
        signed = ((3, 4, 5, 6), "p", "p-req", ("tcp://127.0.0.1:7000",), 1)
        decoders = [scheduler("d"), scheduler("d", key)]
        counter = iter(range(1 << 62))

        def feed(blob):
            try:
                params = msgspec.msgpack.decode(blob)
            except (msgspec.DecodeError, ValueError, RecursionError):  # bad UTF-8 included
                return  # not JSON-shaped: vLLM never hands such params over
            for sched in decoders:
                sched._spent = type(sched._spent)()  # each blob judged alone, not as a replay of the last
                req = EngineRequest(f"r{next(counter)}", 18, dict(params) if isinstance(params, dict) else params)
                try:
                    n, _ = sched.get_num_new_matched_tokens(req, 0)
                    sched.update_state_after_alloc(req, [1, 2, 3, 4, 5], n)
                except Exception as e:  # noqa: BLE001
                    _kvt_only(e)
                for r in sched.build_connector_meta().reqs_to_recv.values():
                    got = (tuple(r.remote.block_ids), r.remote.engine_id, r.remote.request_id,
                           tuple(r.remote.endpoints), r.remote.tp_size)
                    assert sched._secret is None or got == signed, f"read what the prefill engine did not sign: {got}"
        return msgspec.msgpack.encode(params), feed

    def digest_request():
        """What an agent with integrity checks on answers a (mutated) digest request: a
        reply, never a crash, whatever the layout name, ids or slice of the blocks."""
        from kvt import Agent, integrity
        from kvt.config import load_config

        agent = Agent(name="fz", config=load_config(backend="host", integrity=True))
        buf = memory.empty((16, 4096))
        agent.register_blocks("kv", [buf, buf])
        seed = encode(integrity.DigestRequest(layout="kv", block_ids=np.array([1, 2, 15]).tobytes(),
                                              parts=2, offset=8, length=16))

        def feed(blob):
            decode(agent._answer(blob), HandshakeReply)  # the side channel's handler: always a reply
        feed.keep = (agent, buf)
        return seed, feed

    def ucx_add_remote():
        from kvt_ucx.backend import UcxBackend
        return add_remote_of(UcxBackend, {"ucx": {"NET_DEVICES": "lo"}, "timeout": 2})

    return {f.__name__: f for f in (wire_agent_info, wire_handshake, host_add_remote, host_server,
                                    nixl_add_remote, nixl_rkey, nixl_address, ucx_add_remote,
                                    kv_transfer_params, digest_request)}


def _kvt_only(e: BaseException) -> None:
    from kvt.errors import KvtError
    if not isinstance(e, KvtError):
        raise e


def blob_for(target: str, seed_blob: bytes, seed: int, i: int) -> bytes:
    return mutate(seed_blob, random.Random(f"{target}:{seed}:{i}"))


def main() -> int:
    target, count, seed, progress = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    random.seed(0)
    seed_blob, feed = targets()[target]()
    Path(progress + ".seed").write_bytes(seed_blob)
    replay = sorted(REGRESSIONS.glob(f"{target}-*.bin")) if REGRESSIONS.is_dir() else []
    jobs = [(p.name, p.read_bytes()) for p in replay]
    jobs += [(str(i), None) for i in range(count)]
    fd = os.open(progress, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for label, blob in jobs:
        if blob is None:
            blob = blob_for(target, seed_blob, seed, int(label))
        os.pwrite(fd, label.encode().ljust(64), 0)
        try:
            feed(blob)
        except Exception as e:  # noqa: BLE001
            try:
                _kvt_only(e)
            except BaseException:
                print(f"blob {label}: {type(e).__name__}: {e}", file=sys.stderr)
                traceback.print_exc()
                return 3
    os.pwrite(fd, b"done".ljust(64), 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
