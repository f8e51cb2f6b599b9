"""kvt.sandbox: a peer's bytes tried in a child process first; what kills or
hangs the child is refused, and the next check starts a new one."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvt import sandbox
from kvt.errors import WireError

PROBE = f"{__name__}:probe"


def probe(settings):
    """A double of a plugin's probe: the payload says what the library does with it."""
    if settings.get("broken"):
        raise RuntimeError("the library does not load")

    def check(payload: bytes) -> None:
        if payload == b"abort":
            os.abort()
        if payload == b"hang":
            time.sleep(60)
        if payload == b"raise":
            raise ValueError("an error the caller gets typed when it makes the same call")
    return check


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """Children of this test only, able to import this module."""
    monkeypatch.setattr(sandbox, "_children", {})
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    yield
    for child in sandbox._children.values():
        child.proc.kill()
        child.proc.wait()


def test_bytes_the_library_survives_pass_and_its_errors_are_not_crashes():
    for payload in (b"", b"fine", b"raise", b"x" * (1 << 20)):
        sandbox.vet(PROBE, {}, payload, "refused")


def test_bytes_that_kill_the_child_are_refused_and_the_next_check_starts_a_new_child():
    sandbox.vet(PROBE, {}, b"fine", "refused")
    (first,) = sandbox._children.values()
    with pytest.raises(WireError, match="^forged blob of 'p'$"):
        sandbox.vet(PROBE, {}, b"abort", "forged blob of 'p'")
    assert first.proc.poll() is not None and not sandbox._children
    sandbox.vet(PROBE, {}, b"fine", "refused")
    (second,) = sandbox._children.values()
    assert second.proc.pid != first.proc.pid


def test_bytes_that_hang_the_child_are_refused_within_the_check_timeout(monkeypatch):
    monkeypatch.setattr(sandbox, "CHECK_TIMEOUT", 1.0)
    t = time.monotonic()
    with pytest.raises(WireError, match="hung"):
        sandbox.vet(PROBE, {}, b"hang", "hung")
    assert time.monotonic() - t < 10
    sandbox.vet(PROBE, {}, b"fine", "refused")


def test_one_long_lived_child_per_probe_and_settings_the_least_recently_used_beyond_the_cap(monkeypatch):
    monkeypatch.setattr(sandbox, "MAX_CHILDREN", 2)
    for _ in range(3):
        sandbox.vet(PROBE, {"UCX_TLS": "tcp"}, b"fine", "refused")
        sandbox.vet(PROBE, {"UCX_TLS": "cma"}, b"fine", "refused")
    tcp, cma = sandbox._children.values()
    sandbox.vet(PROBE, {"UCX_TLS": "tcp"}, b"fine", "refused")
    sandbox.vet(PROBE, {"UCX_TLS": "rc"}, b"fine", "refused")
    assert list(sandbox._children.values())[0] is tcp and len(sandbox._children) == 2
    assert cma.proc.wait(5) is not None


def test_a_child_started_ahead_serves_the_first_check():
    sandbox.start(PROBE, {})
    (child,) = sandbox._children.values()
    sandbox.vet(PROBE, {}, b"fine", "refused")
    assert list(sandbox._children.values()) == [child] and child.up


def test_a_forked_process_starts_its_own_child():
    """The parent's child answers the parent's pipe only, and a fork taken
    while another thread was mid-check (holding the lock) does not deadlock."""
    import signal

    sandbox.vet(PROBE, {}, b"fine", "refused")
    (parent_child,) = sandbox._children.values()
    with sandbox._lock:
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a deadlock ends the child with SIGALRM
            try:
                sandbox.vet(PROBE, {}, b"fine", "refused")
                (mine,) = sandbox._children.values()
                os._exit(0 if mine.proc.pid != parent_child.proc.pid else 1)
            except BaseException:
                os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    sandbox.vet(PROBE, {}, b"fine", "refused")
    assert list(sandbox._children.values()) == [parent_child]


def test_a_forked_process_does_not_keep_the_parents_child_alive():
    """A fork closes its copies of the parent's pipes: the parent's child
    still ends when the parent's end of its input closes (as when the parent
    exits), however long the fork lives."""
    import signal

    sandbox.vet(PROBE, {}, b"fine", "refused")
    (child,) = sandbox._children.values()
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    try:
        child.proc.stdin.close()
        assert child.proc.wait(10) == 0  # it saw the end of its input and returned
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_probe_that_cannot_start_is_a_wire_error_that_says_so():
    with pytest.raises(WireError, match="did not start"):
        sandbox.vet(PROBE, {"broken": True}, b"fine", "refused")


def test_no_interpreter_to_start_is_a_wire_error(monkeypatch):
    monkeypatch.setattr(sandbox, "CHILD", ["/nonexistent/python"])
    sandbox.start(PROBE, {})
    with pytest.raises(WireError, match="could not start"):
        sandbox.vet(PROBE, {}, b"fine", "refused")


def test_a_child_is_replaced_after_its_share_of_checks(monkeypatch):
    """NIXL keeps a connection to every peer whose blob the child loaded, at
    both ends, so a long-lived child piled them up (one socket per vetted
    blob in the peers too, until their process ran out of descriptors)."""
    monkeypatch.setattr(sandbox, "MAX_CHECKS", 3)
    pids = []
    for _ in range(7):
        sandbox.vet(PROBE, {}, b"fine", "refused")
        (child,) = sandbox._children.values()
        pids.append(child.proc.pid)
    assert len(set(pids)) == 3 and pids[2] != pids[0] and pids[3] == pids[2] == pids[4]
