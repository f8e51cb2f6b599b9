"""Host mirrors for device memory (CUDA or any other torch device).

Each registered device region gets a host buffer of the same size.  Rows in
device address space are translated to mirror addresses (vectorised); before
device bytes are read they are copied device -> mirror, after bytes are
written into the mirror they are copied mirror -> device, with torch copies.
Block-aligned batches (the KV-cache case) move as one ``index_select``;
anything else moves run by run.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvt.errors import InvalidArgument
from kvt.types import Descs

from kvt.memcopy import coalesce


class _Table(NamedTuple):
    """One consistent view of the mirrors, published in one assignment."""

    rows: Descs              # the device regions
    flat: list               # each one's device bytes (torch uint8)
    mirror: list             # and its host mirror
    mirror_base: np.ndarray  # the mirrors' addresses


_EMPTY = _Table(Descs.empty(), [], [], np.zeros(0, np.uint64))


class Mirrors:
    """Mirrors of every registered device region, keyed by registration.

    Server threads translate peers' rows while the owner registers and
    deregisters: each call reads ``_table`` once, so it never mixes one
    table's region indices with another's addresses (a deregistration
    renumbers the regions after the removed one), and the tensors it uses
    stay alive through its reference."""

    def __init__(self):
        self._by_handle: dict[int, list[tuple[object, object]]] = {}  # handle -> [(device flat, mirror)]
        self._table = _EMPTY

    def add(self, handle: int, descs: Descs) -> None:
        import torch

        if len(descs.tensors) != len(descs):
            raise InvalidArgument(f"{descs.kind.value} memory is staged through host buffers with torch, so it "
                                  "must be registered as torch tensors (Descs.from_buffers), not raw rows")
        pin = torch.cuda.is_available()
        pairs = []
        for t in descs.tensors:
            flat = t.detach().reshape(-1).view(torch.uint8)
            pairs.append((flat, torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=pin)))
        self._by_handle[handle] = pairs
        self._rebuild()

    def remove(self, handle: int) -> None:
        self._by_handle.pop(handle, None)
        self._rebuild()

    def _rebuild(self) -> None:
        pairs = [p for ps in self._by_handle.values() for p in ps]
        rows = np.array([(f.data_ptr(), f.numel(), f.device.index or 0) for f, _ in pairs], np.uint64)
        self._table = _Table(Descs(rows.reshape(-1, 3)), [f for f, _ in pairs], [m for _, m in pairs],
                             np.array([m.data_ptr() for _, m in pairs], np.uint64))

    @staticmethod
    def _where(table: _Table, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        where = Descs(rows).locate(table.rows)
        if (where < 0).any():
            raise InvalidArgument("device rows outside the staged regions")
        return where, rows[:, 0] - table.rows.addrs[where]

    def translate(self, rows: np.ndarray) -> np.ndarray:
        """Mirror addresses of device ``rows`` ``(k, 3)``."""
        table = self._table
        where, offs = self._where(table, rows)
        return table.mirror_base[where] + offs

    def to_host(self, rows: np.ndarray) -> None:
        """device -> mirror for ``rows`` (before they are read)."""
        self._copy(rows, to_host=True)

    def to_device(self, rows: np.ndarray) -> None:
        """mirror -> device for ``rows`` (after they were written)."""
        self._copy(rows, to_host=False)

    def _copy(self, rows: np.ndarray, to_host: bool) -> None:
        import torch

        if not len(rows):
            return
        table = self._table
        where, offs = self._where(table, rows)
        for r in np.unique(where).tolist():
            sel = where == r
            o, n = offs[sel], rows[sel, 1]
            dev, mir = table.flat[r], table.mirror[r]
            src, dst = (dev, mir) if to_host else (mir, dev)
            L = int(n[0])
            if L and (n == L).all() and not (o % L).any() and dev.numel() % L == 0:
                idx = torch.from_numpy((o // L).astype(np.int64)).to(dst.device)
                dst.view(-1, L).index_copy_(0, idx, src.view(-1, L).index_select(0, idx.to(src.device)).to(dst.device))
                continue
            o, _, n = coalesce(o, o, n)
            for a, k in zip(o.tolist(), n.tolist()):
                dst[a:a + k].copy_(src[a:a + k])

    def __len__(self) -> int:
        return len(self._table.flat)
