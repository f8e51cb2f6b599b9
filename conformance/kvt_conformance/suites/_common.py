"""Small helpers the suites share."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from kvt.errors import InvalidHandle
from kvt.types import Op, is_settled

from ..buffers import pattern

#: seeds of the two sides' contents; the destination starts zeroed
NEAR_SEED, FAR_SEED = 11, 22


def seeds(op: Op) -> tuple[int | None, int | None]:
    """(near seed, far seed): only the source side of ``op`` is filled."""
    return (None, FAR_SEED) if op is Op.READ else (NEAR_SEED, None)


def expected(op: Op, nbytes_dst: int, block_len: int, near_ids: Any, far_ids: Any,
             nbytes_src: int | None = None) -> np.ndarray:
    """The destination's bytes after ``op`` moved blocks ``far_ids`` <-> ``near_ids``
    of ``block_len`` bytes from a source filled by ``seeds(op)``."""
    src_seed = FAR_SEED if op is Op.READ else NEAR_SEED
    src_ids, dst_ids = (far_ids, near_ids) if op is Op.READ else (near_ids, far_ids)
    src = pattern(src_seed, nbytes_dst if nbytes_src is None else nbytes_src).reshape(-1, block_len)
    out = np.zeros((nbytes_dst // block_len, block_len), np.uint8)
    out[np.asarray(dst_ids, np.int64)] = src[np.asarray(src_ids, np.int64)]
    return out.ravel()


def assert_released(backend: Any, handle: Any) -> None:
    """What ``handle`` answers once released: a handle is gone
    (``InvalidHandle`` from ``check_state`` and from a second ``release``);
    ``SETTLED`` is no handle, so it stays ``DONE`` and releasing it again
    does nothing."""
    if is_settled(handle):
        assert backend.check_state(handle).done, "check_state(SETTLED) must be DONE, released or not"
        backend.release(handle)
        return
    with pytest.raises(InvalidHandle):
        backend.check_state(handle)
    with pytest.raises(InvalidHandle):
        backend.release(handle)


def destination(op: Op, near: Any, far: Any) -> Any:
    return near if op is Op.READ else far


def assert_bytes(got: np.ndarray, want: np.ndarray, what: str = "destination") -> None:
    """Byte-for-byte equality, reporting the first differing offset."""
    got, want = np.asarray(got, np.uint8).ravel(), np.asarray(want, np.uint8).ravel()
    assert got.size == want.size, f"{what}: {got.size} bytes, expected {want.size}"
    bad = np.flatnonzero(got != want)
    assert not bad.size, (f"{what}: {bad.size} of {want.size} bytes differ; first at offset {bad[0]} "
                          f"(got {got[bad[0]]}, expected {want[bad[0]]})")


#: the contract tests' transfers: many non-contiguous blocks, several MiB in all,
#: repeated, so that a backend that signals before its last byte lands is seen doing it
CONTRACT_BLOCK, CONTRACT_BLOCKS, CONTRACT_REPEATS = 8192, 512, 6
#: each side's buffer: twice the blocks moved, so that ``scattered`` leaves gaps
CONTRACT_BYTES = 2 * CONTRACT_BLOCK * CONTRACT_BLOCKS


def scattered(seed: int, nblocks: int = CONTRACT_BLOCKS) -> tuple[np.ndarray, np.ndarray]:
    """Two permutations of every other block of a ``2 * nblocks`` buffer:
    (near ids, far ids), different each ``seed``, no two rows contiguous in order."""
    rng = np.random.default_rng(seed)
    return rng.permutation(nblocks) * 2, rng.permutation(nblocks) * 2 + 1



def contract_setup(backend: Any, local_buffer: Any, peer: Any) -> tuple[Any, Any, Any, Any]:
    """The contract tests' buffers, ``CONTRACT_BYTES`` on each side, every
    block prepped, the peer added: ``(near, far, local prep, remote prep)``."""
    near, far = local_buffer(CONTRACT_BYTES), peer.alloc(CONTRACT_BYTES)
    name = backend.add_remote(peer.metadata())
    every = np.arange(2 * CONTRACT_BLOCKS)
    return (near, far, backend.prep(None, near.blocks(CONTRACT_BLOCK, every)),
            backend.prep(name, far.blocks(CONTRACT_BLOCK, every)))


def contract_source(op: Op, near: Any, far: Any, peer: Any, seed: int) -> np.ndarray:
    """Fill the source side of ``op`` from ``seed`` (for a READ also zero this
    agent's buffer, its destination) and return the source's bytes."""
    if op is Op.WRITE:
        return near.fill(seed)
    peer.fill_blocks(far.key, CONTRACT_BLOCK, list(range(2 * CONTRACT_BLOCKS)), seed)
    near.write(np.zeros(CONTRACT_BYTES, np.uint8))
    return far.read()


def moved(src: np.ndarray, src_ids: Any, dst_ids: Any) -> np.ndarray:
    """A zeroed contract buffer after blocks ``src_ids`` of ``src`` were copied to ``dst_ids``."""
    want = np.zeros((2 * CONTRACT_BLOCKS, CONTRACT_BLOCK), np.uint8)
    want[dst_ids] = src.reshape(-1, CONTRACT_BLOCK)[src_ids]
    return want.ravel()


#: transfers that must still be moving when the test acts (release, deregister): 8 MiB in 16,384
#: rows, so that one takes a while even as a local memcpy driven from Python
SLOW_BLOCK, SLOW_BYTES = 512, 8 << 20
