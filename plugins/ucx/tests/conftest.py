import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # spawned peers import ucx_peer from here

from ucx_peer import LOOPBACK_ONLY, peer_process  # noqa: E402

TIMEOUT = 5.0  # the backends' ``timeout`` option in these tests


@pytest.fixture
def make_backend():
    """UcxBackend factory; every instance is closed after the test."""
    from kvt_ucx import UcxBackend

    made = []

    def make(name: str = "initiator", **options):
        b = UcxBackend(name, {"timeout": TIMEOUT, "ucx": LOOPBACK_ONLY, **options})
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


@pytest.fixture
def backend(make_backend):
    return make_backend()


@pytest.fixture
def peer():
    with peer_process("peer") as p:
        yield p


@pytest.fixture
def spawn_peer():
    """More peers (each stopped and reaped after the test)."""
    from contextlib import ExitStack

    with ExitStack() as stack:
        yield lambda name, **options: stack.enter_context(peer_process(name, **options))
