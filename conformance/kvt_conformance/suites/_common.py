"""Small helpers the suites share."""

from __future__ import annotations

from typing import Any

import numpy as np
from kvt.types import Op

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


def scattered(seed: int, nblocks: int = CONTRACT_BLOCKS) -> tuple[np.ndarray, np.ndarray]:
    """Two permutations of every other block of a ``2 * nblocks`` buffer:
    (near ids, far ids), different each ``seed``, no two rows contiguous in order."""
    rng = np.random.default_rng(seed)
    return rng.permutation(nblocks) * 2, rng.permutation(nblocks) * 2 + 1
