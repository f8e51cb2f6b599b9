"""Test buffers of every memory kind, and the byte patterns the suites check.

A ``Buffer`` is zeroed memory of one kind (a numpy array for DRAM, a torch
tensor for device memory) that the suites register, address by block and
read back byte for byte.  ``pattern(seed, n)`` gives the same bytes in every
process, so a peer fills memory and the test computes what to expect
without shipping it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from kvt.types import Descs, MemKind

__all__ = ["Buffer", "pattern", "device_for", "unavailable_reason"]


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """``nbytes`` pseudo-random bytes, identical for a given seed everywhere."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _accelerator() -> Any:
    """The first torch accelerator that is neither CPU nor CUDA, or None."""
    import torch

    acc = getattr(torch, "accelerator", None)
    dev = acc.current_accelerator() if acc is not None and acc.is_available() else None
    return dev if dev is not None and dev.type not in ("cpu", "cuda") else None


def unavailable_reason(kind: MemKind) -> str | None:
    """Why memory of ``kind`` cannot be allocated on this machine, or None."""
    if kind is MemKind.DRAM:
        return None
    try:
        import torch
    except ImportError:
        return f"{kind.value} buffers need torch, which is not installed"
    if kind is MemKind.VRAM:
        return None if torch.cuda.is_available() else "no CUDA device (torch.cuda.is_available() is False)"
    return None if _accelerator() is not None else "no torch accelerator other than CPU/CUDA on this machine"


def device_for(kind: MemKind) -> Any:
    """The torch device used for ``kind`` (None for DRAM)."""
    if kind is MemKind.DRAM:
        return None
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if kind is MemKind.VRAM else _accelerator()


def _mapped_at(addr: int, nbytes: int) -> np.ndarray:
    """Zeroed anonymous memory at exactly ``addr`` (Linux ``MAP_FIXED_NOREPLACE``:
    never over an existing mapping), mapped until the process exits;
    ``OSError`` if it cannot be had there."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fixed_noreplace = 0x100000  # older kernels take it as a hint: the address check below catches that
    got = libc.mmap(addr, nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | fixed_noreplace, -1, 0)
    if got != addr:
        if got not in (None, ctypes.c_void_p(-1).value):
            libc.munmap(ctypes.c_void_p(got), ctypes.c_size_t(nbytes))
        raise OSError(ctypes.get_errno(), f"cannot map {nbytes} bytes at {addr:#x}")
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


class Buffer:
    """``nbytes`` of zeroed memory of ``kind``.  Not registered by itself.
    ``at``: DRAM at that very address (for a restarted peer with memory
    where its first process had registered some); ``OSError`` if taken."""

    def __init__(self, nbytes: int, kind: MemKind | str = MemKind.DRAM, at: int | None = None):
        self.kind = MemKind(kind)
        self.nbytes = int(nbytes)
        if at is not None and self.kind is not MemKind.DRAM:
            raise ValueError("only DRAM buffers can be placed at an address")
        if self.kind is MemKind.DRAM:
            self.mem: Any = np.zeros(self.nbytes, np.uint8) if at is None else _mapped_at(at, self.nbytes)
            self.addr, self.device = self.mem.ctypes.data, 0
        else:
            import torch

            self.mem = torch.zeros(self.nbytes, dtype=torch.uint8, device=device_for(self.kind))
            self.addr, self.device = self.mem.data_ptr(), self.mem.device.index or 0

    def region(self) -> Descs:
        """One row covering the whole buffer (what ``register`` takes)."""
        return Descs.from_buffers([self.mem], self.kind)

    def blocks(self, block_len: int, ids: Any, offset: int = 0) -> Descs:
        """Descriptors of blocks ``ids`` of ``block_len`` bytes, from ``offset``."""
        return Descs.from_blocks(self.addr + offset, block_len, ids, device=self.device, kind=self.kind)

    def read(self, offset: int = 0, length: int | None = None) -> np.ndarray:
        """A host copy of the bytes (all by default)."""
        end = self.nbytes if length is None else offset + length
        part = self.mem[offset:end]
        return part.copy() if self.kind is MemKind.DRAM else part.cpu().numpy()

    def write(self, data: np.ndarray, offset: int = 0) -> None:
        data = np.ascontiguousarray(data, np.uint8).ravel()
        if self.kind is MemKind.DRAM:
            self.mem[offset:offset + data.size] = data
        else:
            import torch

            self.mem[offset:offset + data.size].copy_(torch.from_numpy(data))
        self._sync()

    def fill(self, seed: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Write ``pattern(seed, length)`` at ``offset``; returns the pattern."""
        data = pattern(seed, self.nbytes - offset if length is None else length)
        self.write(data, offset)
        return data

    def fill_byte(self, value: int) -> None:
        """Set every byte to ``value`` (a memset: no buffer-sized temporary)."""
        if self.kind is MemKind.DRAM:
            self.mem.fill(value)
        else:
            self.mem.fill_(value)
            self._sync()

    def fill_blocks(self, block_len: int, ids: Any, seed: int) -> np.ndarray:
        """Fill blocks ``ids`` with one pattern, block after block; returns it as ``(len(ids), block_len)``."""
        ids = np.asarray(ids, np.int64)
        data = pattern(seed, ids.size * block_len).reshape(ids.size, block_len)
        if self.kind is MemKind.DRAM:
            self.mem[: (self.nbytes // block_len) * block_len].reshape(-1, block_len)[ids] = data
        else:
            import torch

            view = self.mem[: (self.nbytes // block_len) * block_len].view(-1, block_len)
            view[torch.from_numpy(ids).to(view.device)] = torch.from_numpy(data).to(view.device)
            self._sync()
        return data

    def _sync(self) -> None:
        if self.kind is not MemKind.DRAM:
            import torch

            if self.mem.device.type == "cuda":
                torch.cuda.synchronize(self.mem.device)

    def __repr__(self) -> str:
        return f"Buffer({self.nbytes} B {self.kind.value} at {self.addr:#x})"
