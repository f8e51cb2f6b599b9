import itertools
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # spawned peers import peerproc from here

try:
    import nixl  # noqa: F401
except Exception as e:  # the only reason these tests may skip
    _skip = f"nixl cannot be imported ({type(e).__name__}: {e}); pip install nixl"
else:
    _skip = None


def pytest_collection_modifyitems(config, items):
    if _skip:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=_skip))


_names = itertools.count()


def _factory(create):
    """A fixture body: ``create(...)`` objects made during the test, each
    closed at its end (even when the test failed)."""
    made = []

    def make(*args, **kwargs):
        made.append(create(*args, **kwargs))
        return made[-1]

    yield make
    for obj in made:
        obj.close()


@pytest.fixture
def make_backend():
    """NixlBackend instances (unique agent names; timeout 5 s unless given)."""
    from kvt_nixl.backend import NixlBackend

    yield from _factory(lambda name="test", **options: NixlBackend(
        f"{name}-{os.getpid()}-{next(_names)}", {"timeout": 5.0, **options}))


@pytest.fixture
def spawn_peer():
    """Peer processes of this test alone, stopped (or killed) at its end."""
    from peerproc import Peer

    yield from _factory(lambda name="peer", **options: Peer(f"{name}-{next(_names)}", {"timeout": 5.0, **options}))


@pytest.fixture(scope="module")
def _shared_peer():
    from peerproc import Peer

    p = Peer(f"shared-{next(_names)}", {"timeout": 5.0})
    yield p
    p.close()


@pytest.fixture
def peer(_shared_peer):
    """A peer process shared by the module's tests (spawning one costs
    seconds); its memory is restored to the pattern before each test."""
    if not _shared_peer.proc.is_alive():
        pytest.fail("the shared peer process died in an earlier test")
    _shared_peer.call("reset")
    return _shared_peer


@pytest.fixture
def local_buf():
    """A zeroed local buffer shaped like the peer's."""
    from peerproc import BLOCK, NUM_BLOCKS

    return np.zeros((NUM_BLOCKS, BLOCK), np.uint8)
