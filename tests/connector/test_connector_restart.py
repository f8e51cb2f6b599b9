"""A prefill engine that restarts under the same engine id on the same
side-channel port, in real processes: params it handed off before the
restart are never read from the new process (same block ids, other
contents), and the new process's requests are read even by a decode engine
that still holds a connection to the old one."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvt.connector import ConnectorScheduler, EngineRequest
from test_connector_worker import SPEC, config, pump, workers  # noqa: F401 - workers is a fixture

SCRIPT = Path(__file__).with_name("restarting_prefill.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prefill:
    """One incarnation of the prefill engine (restarting_prefill.py)."""

    def __init__(self, port: int, req_id: str, blocks: list[int], seed: int):
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), str(port), req_id, ",".join(map(str, blocks)),
                                      str(seed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        first = self._line()
        assert first, "the prefill process did not start within 60 s"
        first = json.loads(first)
        self.params = first["params"]
        self.blocks = {n: torch.tensor(v) for n, v in first["blocks"].items()}

    def _line(self, timeout: float = 60.0) -> str:
        """Its next line; "" if it says nothing within ``timeout``."""
        ready = select.select([self.proc.stdout], [], [], timeout)[0]
        return self.proc.stdout.readline() if ready else ""

    def released(self, timeout: float) -> dict | None:
        """The next request it releases, if any within ``timeout``."""
        line = self._line(timeout)
        return json.loads(line) if line else None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(30)


def _load(d, dsched, req_id, params, dst):
    req = EngineRequest(req_id, 2 * SPEC.block_size, dict(params))
    dsched.update_state_after_alloc(req, dst, dsched.get_num_new_matched_tokens(req, 0)[0])
    d.start_load_kv(dsched.build_connector_meta())
    done = [set(), set()]
    pump([(d, done)], lambda: req_id in done[1], timeout=60)


def _holds(dkv, dst, prefill) -> bool:
    return all(torch.equal(dkv[n][:, dst].float(), prefill.blocks[n]) for n in dkv)


@pytest.mark.timeout(180)
def test_params_from_before_a_restart_are_not_read_from_the_new_process(workers):  # noqa: F811
    port = _port()
    old = Prefill(port, "pa", [1, 2], seed=1)
    old.kill()  # the router still holds its params for "pa"
    new = Prefill(port, "pb", [1, 2], seed=2)  # same engine, same port, same block ids, other contents
    try:
        d, dkv, _ = workers("d")
        _load(d, ConnectorScheduler(config("d")), "da", old.params, [3, 4])
        assert d.get_block_ids_with_load_errors() == {3, 4}
        assert "restarted" in d.failure_reasons()["da"]
        assert not _holds(dkv, [3, 4], new)
        assert new.released(1.0) is None  # and the new process heard of no request of ours
    finally:
        new.stop()


@pytest.mark.timeout(180)
def test_a_restarted_processs_requests_are_read_through_a_fresh_connection(workers):  # noqa: F811
    port = _port()
    d, dkv, _ = workers("d")
    dsched = ConnectorScheduler(config("d"))
    old = Prefill(port, "pa", [1, 2], seed=1)
    try:
        _load(d, dsched, "da", old.params, [3, 4])
        assert not d.get_block_ids_with_load_errors() and _holds(dkv, [3, 4], old)
    finally:
        old.kill()  # restarts with the decode engine still connected to the old process
    new = Prefill(port, "pb", [5, 6], seed=2)
    try:
        _load(d, dsched, "db", new.params, [7, 8])
        assert not d.get_block_ids_with_load_errors(), d.failure_reasons()
        assert _holds(dkv, [7, 8], new)
        assert new.released(30.0) == {"released": "pb", "by_readers": 1}  # told at once, not at its timeout
    finally:
        new.stop()
