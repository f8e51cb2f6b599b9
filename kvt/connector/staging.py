"""Host-buffer staging (``kv_buffer_device="cpu"``): for devices a backend
cannot reach, the connector registers host copies of the KV cache, copies
device -> host before a request's blocks are read, and host -> device after
a read lands.

Host buffers come from ``kvt.memory`` (shared segments), so same-host peers
on the host backend reach them at memcpy speed.  Copies are one
``index_copy_`` per buffer (vectorised over blocks) on same-size integer
views, so every dtype moves bit for bit (fp8 too); an engine with its own
kernels passes ``copy_blocks`` instead.
"""

from __future__ import annotations

from typing import Callable, Literal, Sequence

import numpy as np

__all__ = ["CopyBlocks", "HostStaging", "copy_blocks"]

#: ``copy_blocks(src_buffers, dst_buffers, block_ids, direction)``; ``HostStaging`` passes
#: ``block_ids`` as a 1-D int64 numpy array (no per-block Python objects)
CopyBlocks = Callable[[Sequence, Sequence, Sequence[int], Literal["d2h", "h2d"]], None]


def copy_blocks(src: Sequence, dst: Sequence, block_ids: Sequence[int], direction: str) -> None:
    """``dst[b] = src[b]`` for every block id, every buffer (block-first).
    The index tensor is built once (per device), not once per buffer."""
    import torch

    if not len(block_ids):
        return
    ids = torch.from_numpy(np.ascontiguousarray(block_ids, dtype=np.int64))
    on: dict = {}  # device -> the index there

    def index(device):
        if device not in on:
            on[device] = ids.to(device)
        return on[device]

    for s, d in zip(src, dst):
        s, d = _bits(s), _bits(d)
        picked = s.index_select(0, index(s.device))
        d.index_copy_(0, index(d.device), picked.to(d.device, non_blocking=direction == "h2d"))
    if direction == "h2d" and torch.cuda.is_available():
        torch.cuda.synchronize()


_BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _bits(t):
    """``t`` as integers of its element size: a copy moves bits, and torch's
    index ops lack some dtypes (fp8 on CPU)."""
    import torch

    name = _BITS.get(t.element_size())
    return t if name is None else t.view(getattr(torch, name))


class HostStaging:
    """Host mirrors of the engine's block-first device buffers."""

    def __init__(self, device_buffers: Sequence, copy: CopyBlocks | None = None):
        from ..memory import empty_tensor

        self.device = list(device_buffers)
        self.host = [empty_tensor(tuple(t.shape), t.dtype) for t in self.device]
        self._copy = copy or copy_blocks

    def save(self, block_ids: Sequence[int]) -> None:
        """Device -> host, before the blocks may be read."""
        self._copy(self.device, self.host, np.asarray(block_ids, dtype=np.int64), "d2h")

    def load(self, block_ids: Sequence[int]) -> None:
        """Host -> device, after a read landed."""
        self._copy(self.host, self.device, np.asarray(block_ids, dtype=np.int64), "h2d")
