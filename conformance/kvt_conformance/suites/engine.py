"""An engine scenario: a scheduler loop drives a prefill agent (the peer,
in another process when the backend declares ``remote``) and a decode
agent (this process) the way a disaggregated engine does:

* the prefill side computes a request's KV blocks (one region per layer)
  and keeps them until the decode side says it is done with them;
* the scheduler admits requests step by step; for each it allocates decode
  blocks and posts one READ of every full block of every layer, with a
  notification that tells the prefill side to free its blocks;
* a prompt shorter than one block has no full block: no read is scheduled,
  the prefill side is told to free at once;
* an aborted request has its in-flight read released and its decode blocks
  handed straight to the next request;
* the loop polls all in-flight reads together and checks each request's KV
  contents the moment its read is DONE; at the end every decode block holds
  exactly what its current owner expects, and nothing else was touched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pytest
from kvt.types import Descs, Op

from ..buffers import pattern
from ..fixtures import BackendFixtures
from ..requirements import requires
from ._common import assert_bytes

LAYERS, BLOCKS, BLOCK_TOKENS, TOKEN_BYTES = 3, 48, 16, 64
BLOCK = BLOCK_TOKENS * TOKEN_BYTES


@dataclass
class Request:
    rid: str
    tokens: int
    seed: int
    abort: bool = False
    prefill_blocks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    decode_blocks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    handle: object = None
    verified: bool = False

    @property
    def full_blocks(self) -> int:
        return self.tokens // BLOCK_TOKENS

    def kv(self, layer: int) -> np.ndarray:
        """The KV bytes prefill computes for this request's full blocks of ``layer``."""
        return pattern(self.seed * 100 + layer, self.full_blocks * BLOCK).reshape(self.full_blocks, BLOCK)


def schedule() -> list[list[Request]]:
    """Requests admitted step by step: r1 and r5 are shorter than one block;
    r2 is aborted while its read may be in flight, and r3 and r4 reuse its
    decode blocks."""
    return [
        [Request("r0", 5 * BLOCK_TOKENS + 3, 1), Request("r1", BLOCK_TOKENS - 6, 2),
         Request("r2", 9 * BLOCK_TOKENS, 3, abort=True)],
        [Request("r3", 6 * BLOCK_TOKENS + 15, 4)],
        [Request("r4", 11 * BLOCK_TOKENS, 5), Request("r5", 1, 6)],
    ]


@requires("READ", "notifications")
class EngineScenarioTests(BackendFixtures):
    area = "engine"

    def test_scheduler_drives_prefill_and_decode(self, backend, local_buffer, peer, wait_for):
        prefill_layers = [peer.alloc(BLOCKS * BLOCK) for _ in range(LAYERS)]
        decode_layers = [local_buffer(BLOCKS * BLOCK) for _ in range(LAYERS)]
        prefill = backend.add_remote(peer.metadata())
        all_ids = np.arange(BLOCKS)
        # prepped once, as engines do: every block of every layer, layer-major
        local = backend.prep(None, Descs.from_blocks([b.addr for b in decode_layers], BLOCK, all_ids))
        remote = backend.prep(prefill, Descs.from_blocks([b.addr for b in prefill_layers], BLOCK, all_ids))
        prefill_free = list(np.random.default_rng(0).permutation(BLOCKS))
        decode_free = list(range(BLOCKS))
        owner = np.full(BLOCKS, -1)  # decode block -> index into `done` of the request holding it
        done: list[Request] = []
        in_flight: list[Request] = []
        expected_notifs: dict[bytes, bool] = {}  # message -> must arrive (False: may arrive)

        def rows(block_ids: np.ndarray) -> np.ndarray:  # descriptor indices of blocks in every layer
            return (np.arange(LAYERS)[:, None] * BLOCKS + block_ids[None, :]).ravel()

        for step in schedule():
            for req in step:
                n = req.full_blocks
                if n == 0:  # nothing to pull: the prefill side frees at once
                    backend.notify(prefill, b"free:" + req.rid.encode())
                    expected_notifs[b"free:" + req.rid.encode()] = True
                    continue
                req.prefill_blocks = np.array([prefill_free.pop() for _ in range(n)])
                for layer, buf in enumerate(prefill_layers):  # "run prefill"
                    peer.fill_blocks(buf.key, BLOCK, req.prefill_blocks.tolist(), req.seed * 100 + layer)
                req.decode_blocks = np.array([decode_free.pop(0) for _ in range(n)])
                msg = b"done:" + req.rid.encode()
                req.handle = backend.transfer(Op.READ, local, rows(req.decode_blocks),
                                              remote, rows(req.prefill_blocks), notif=msg)
                if req.abort:
                    backend.release(req.handle)  # in flight or not: after this no byte lands
                    backend.notify(prefill, b"abort:" + req.rid.encode())
                    expected_notifs[b"abort:" + req.rid.encode()] = True
                    expected_notifs[msg] = False  # it may have completed before the release
                    decode_free[:0] = req.decode_blocks.tolist()  # the next request reuses them
                    continue
                expected_notifs[msg] = True
                in_flight.append(req)
            self._poll(backend, in_flight, decode_layers, owner, done, wait_for)

        deadline = time.monotonic() + wait_for
        while in_flight and time.monotonic() < deadline:
            self._poll(backend, in_flight, decode_layers, owner, done, wait_for)
        assert not in_flight, f"requests {[r.rid for r in in_flight]} still in flight after {wait_for:g}s"

        # every decode block holds its owner's KV; unowned blocks were never written
        for layer, buf in enumerate(decode_layers):
            got = buf.read().reshape(BLOCKS, BLOCK)
            for i, req in enumerate(done):
                assert_bytes(got[req.decode_blocks], req.kv(layer), f"{req.rid} layer {layer} at the end")
                assert (owner[req.decode_blocks] == i).all()
            assert not got[owner < 0].any(), f"layer {layer}: blocks no request owns were written"
        # the prefill side heard about every request exactly as scheduled
        must = [m for m, required in expected_notifs.items() if required]
        got = peer.take_notifs(backend.agent_name, len(must), wait_for)
        got += peer.take_notifs(backend.agent_name, len(expected_notifs), 0.2)  # optional extras
        assert set(must) <= set(got), f"prefill never heard {sorted(set(must) - set(got))}"
        assert set(got) <= set(expected_notifs), f"unexpected notifications {sorted(set(got) - set(expected_notifs))}"

    def _poll(self, backend, in_flight, decode_layers, owner, done, wait_for):
        """One scheduler step: check every in-flight read once; verify the finished."""
        for req in list(in_flight):
            state = backend.check_state(req.handle)
            if state.pending:
                continue
            if state.failed:
                pytest.fail(f"request {req.rid}: read ended in ERR: {state.cause!r}")
            for layer, buf in enumerate(decode_layers):
                got = buf.read().reshape(BLOCKS, BLOCK)[req.decode_blocks]
                assert_bytes(got, req.kv(layer), f"{req.rid} layer {layer} when DONE")
            backend.release(req.handle)
            owner[req.decode_blocks] = len(done)
            done.append(req)
            in_flight.remove(req)
