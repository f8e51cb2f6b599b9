"""Host-buffer staging (``kv_buffer_device="cpu"``): for devices a backend
cannot reach, the connector registers host copies of the KV cache, copies
device -> host before a request's blocks are read, and host -> device after
a read lands.

Host buffers come from ``kvt.memory`` (shared segments), so same-host peers
on the host backend reach them at memcpy speed.  Copies are one
``index_copy_`` per buffer (vectorised over blocks); an engine with its own
kernels passes ``copy_blocks`` instead.
"""

from __future__ import annotations

from typing import Callable, Literal, Sequence

__all__ = ["CopyBlocks", "HostStaging", "copy_blocks"]

#: ``copy_blocks(src_buffers, dst_buffers, block_ids, direction)``
CopyBlocks = Callable[[Sequence, Sequence, Sequence[int], Literal["d2h", "h2d"]], None]


def copy_blocks(src: Sequence, dst: Sequence, block_ids: Sequence[int], direction: str) -> None:
    """``dst[b] = src[b]`` for every block id, every buffer (block-first)."""
    import torch

    if not len(block_ids):
        return
    for s, d in zip(src, dst):
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=s.device)
        picked = s.index_select(0, idx)
        d.index_copy_(0, idx.to(d.device), picked.to(d.device, non_blocking=direction == "h2d"))
    if direction == "h2d" and torch.cuda.is_available():
        torch.cuda.synchronize()


class HostStaging:
    """Host mirrors of the engine's block-first device buffers."""

    def __init__(self, device_buffers: Sequence, copy: CopyBlocks | None = None):
        from ..memory import empty_tensor

        self.device = list(device_buffers)
        self.host = [empty_tensor(tuple(t.shape), t.dtype) for t in self.device]
        self._copy = copy or copy_blocks

    def save(self, block_ids: Sequence[int]) -> None:
        """Device -> host, before the blocks may be read."""
        self._copy(self.device, self.host, list(block_ids), "d2h")

    def load(self, block_ids: Sequence[int]) -> None:
        """Host -> device, after a read landed."""
        self._copy(self.host, self.device, list(block_ids), "h2d")
