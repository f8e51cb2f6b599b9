"""kvt's Agent on the nixl backend: metadata through the handshake side
channel, block reads and writes by id, notifications."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
from kvt import Agent
from peerproc import BLOCK, NUM_BLOCKS, pattern, serve_agent


@pytest.fixture
def remote_agent():
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=serve_agent, args=("prefill-nixl", child), daemon=True)
    proc.start()
    try:
        assert conn.poll(60), "the peer agent did not start"
        yield conn, conn.recv()
        conn.send("stop")
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def test_agent_reads_and_writes_blocks_through_the_handshake(remote_agent):
    conn, endpoint = remote_agent
    mine = np.zeros((NUM_BLOCKS, BLOCK), np.uint8)
    with Agent(name="decode-nixl", backend="nixl", options={"timeout": 5.0}) as agent:
        agent.register_blocks("kv", [mine])
        peer = agent.connect(endpoint, timeout=10)
        assert peer == "prefill-nixl"
        agent.read_blocks(peer, [0, 1, 2], [10, 20, 30], notif=b"read").wait(10)
        np.testing.assert_array_equal(mine[[0, 1, 2]], pattern()[[10, 20, 30]])
        conn.send("notif")
        assert conn.poll(30) and conn.recv() == ("decode-nixl", b"read")
        mine[5] = 7
        agent.write_blocks(peer, [5], [40]).wait(10)
        conn.send("contents")
        assert conn.poll(30)
        theirs = np.frombuffer(conn.recv(), np.uint8).reshape(NUM_BLOCKS, BLOCK)
        assert (theirs[40] == 7).all() and (theirs[:40] == pattern()[:40]).all()
