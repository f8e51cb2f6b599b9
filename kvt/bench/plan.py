"""What a benchmark run measures: its cases, and how long each is timed.

A ``Case`` is one row of the result table: an operation over ``inflight``
requests posted at once, each moving ``batch`` blocks of ``block`` bytes.
Three groups of cases:

* ``sweep``    block size x batch size (bounded by ``max_bytes`` per request)
* ``inflight`` 1, 8, 64 requests in flight at once, one block shape
* ``scale``    1,000 -> 100,000 small blocks in one request

Block ids: the initiator's blocks are contiguous, the target's a random
permutation with no two consecutive ids next to each other, so no backend
(and not the memcpy baseline either) can merge neighbouring blocks into one
bigger copy.  Every process derives the same ids from the case alone.

Each case's iterations cycle through ``rotations(case)`` disjoint sets of
blocks, at least ``Plan.rotate`` bytes per side.  The default,
``WARM_ROTATE`` (1 MiB), keeps small requests in cache while no row hangs
on where one block's pages happen to fall in it (a 256 KiB block's 64
pages spread unevenly over L2's sets in some processes: 18-21 us for
the same copy, by the luck of the allocation).  A *cold* plan rotates
over more than the last-level cache (``cold_default``), so an iteration
finds its blocks the way an engine finds KV written long ago: in memory.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from ..config import MAX_SECONDS
from ..errors import InvalidArgument
from ..types import Op

__all__ = ["Case", "Ids", "Plan", "make_plan", "parse_size", "format_size", "cold_default", "GROUPS", "WARM_ROTATE"]

GROUPS = ("sweep", "inflight", "scale")
KiB, MiB = 1 << 10, 1 << 20
WARM_ROTATE = MiB  #: bytes per side a warm run's cases rotate over: about L2, still warm, several placements
_UNITS = {"": 1, "B": 1, "K": KiB, "KB": KiB, "KIB": KiB, "M": MiB, "MB": MiB, "MIB": MiB,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str | int) -> int:
    """``"4K"`` / ``"4KiB"`` -> 4096, ``"64M"`` -> 67108864 (binary units); positive."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
        if not m or m.group(2).upper() not in _UNITS:
            raise InvalidArgument(f"size {text!r} is not a number with an optional unit (B, K, M, G), e.g. 64K")
        value = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if value <= 0:
        raise InvalidArgument(f"size {text!r} must be positive")
    return value


def format_size(n: int) -> str:
    """4096 -> ``4K``, 67108864 -> ``64M``; other values in bytes."""
    for unit, size in (("G", 1 << 30), ("M", MiB), ("K", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


class Ids(NamedTuple):
    """Block ids of a case: ``local[r]`` pairs with ``remote[r]`` for request ``r``."""

    local: np.ndarray   #: ``(inflight, batch)`` int64, contiguous
    remote: np.ndarray  #: ``(inflight, batch)`` int64, scattered

    def shifted(self, blocks: int) -> "Ids":
        """The same pattern ``blocks`` further on, on both sides."""
        return Ids(self.local + blocks, self.remote + blocks) if blocks else self


@dataclass(frozen=True)
class Case:
    group: str
    op: Op
    block: int         #: bytes per block
    batch: int         #: blocks per request
    inflight: int = 1  #: requests posted before waiting for any

    @property
    def nbytes(self) -> int:
        """Bytes moved by one timed iteration (all requests)."""
        return self.block * self.batch * self.inflight

    @property
    def key(self) -> tuple:
        return (self.group, self.op.value, self.block, self.batch, self.inflight)

    def as_dict(self) -> dict:
        return {**asdict(self), "op": self.op.value, "bytes": self.nbytes}

    def ids(self, rotation: int = 0) -> Ids:
        """The block ids every engine uses for this case (deterministic);
        ``rotation`` k: the same pattern over the k-th next set of blocks."""
        if rotation:
            return self.ids().shifted(rotation * self.batch * self.inflight)
        pool = self.batch * self.inflight
        rng = np.random.default_rng([self.block, self.batch, self.inflight])
        remote = rng.permutation(pool)
        for _ in range(64):  # a random permutation has no +1 step with probability ~1/e
            if not (np.diff(remote) == 1).any():
                break
            remote = rng.permutation(pool)
        else:
            remote = np.arange(pool)[::-1].copy()
        shape = (self.inflight, self.batch)
        return Ids(np.arange(pool, dtype=np.int64).reshape(shape), remote.astype(np.int64).reshape(shape))


@dataclass(frozen=True)
class Plan:
    """The cases and the timing policy of one run (picklable: sent to every process)."""

    cases: tuple[Case, ...]
    budget: float = 0.5     #: seconds of timed iterations per case (after warm-up)
    warmup: int = 2         #: untimed iterations per case
    min_iters: int = 5      #: timed iterations per case, even past the budget
    max_iters: int = 2000   #: timed iterations per case, even within the budget
    timeout: float = 60.0   #: seconds one iteration may take before the case fails
    rotate: int = WARM_ROTATE  #: bytes per side each case rotates over (0: the same blocks every iteration)
    meta: dict = field(default_factory=dict)  #: how the plan was built (for the JSON)

    def rotations(self, case: Case) -> int:
        """How many disjoint sets of blocks ``case``'s iterations cycle through."""
        return max(1, -(-self.rotate // case.nbytes))

    @property
    def arena(self) -> int:
        """Bytes of buffer each side needs: the largest case's blocks, times its rotations."""
        return max(c.nbytes * self.rotations(c) for c in self.cases)

    @property
    def block_sizes(self) -> list[int]:
        return sorted({c.block for c in self.cases})

    def describe(self) -> dict:
        return {"budget_s": self.budget, "warmup": self.warmup, "min_iters": self.min_iters,
                "max_iters": self.max_iters, "timeout_s": self.timeout, "rotate_bytes": self.rotate,
                "arena_bytes": self.arena,
                "cases": len(self.cases), **self.meta}


#: the defaults of a full run, and what ``--quick`` changes
FULL = dict(blocks=[4 * KiB << (2 * i) for i in range(8)],  # 4K, 16K, ... 64M
            batches=[1, 8, 64, 512, 4096], max_bytes=256 * MiB,
            inflight=[1, 8, 64], inflight_shape=(64 * KiB, 64),
            scale=[1000, 10000, 100000], scale_block=4 * KiB,
            budget=0.5, warmup=2, min_iters=5, scaling_ops=2)
# quick: the in-flight and scale rows for the first op only (READ unless --ops says otherwise)
QUICK = dict(FULL, blocks=[4 * KiB, 64 * KiB, MiB, 16 * MiB], batches=[1, 64, 1024], max_bytes=64 * MiB,
             inflight_shape=(64 * KiB, 16), budget=0.05, warmup=1, min_iters=3, scaling_ops=1)


def cold_default() -> int:
    """What ``--cold`` rotates over when given no size: twice the largest CPU
    cache (sysfs), or 64 MiB where the cache size cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            sizes.append(parse_size(f.read_text().strip()))
        except (OSError, InvalidArgument):
            pass
    return 2 * max(sizes) if sizes else 64 * MiB


def _positive(values: Iterable[int], what: str) -> list[int]:
    out = sorted(set(int(v) for v in values))
    if not out or out[0] <= 0:
        raise InvalidArgument(f"{what} must be positive integers, got {list(values)}")
    return out


def make_plan(quick: bool = False, *, groups: Sequence[str] = GROUPS, ops: Sequence[Op | str] = (Op.READ, Op.WRITE),
              **overrides) -> Plan:
    """Build the plan; ``overrides`` replace keys of ``FULL`` / ``QUICK``
    (``blocks``, ``batches``, ``max_bytes``, ``inflight``, ``inflight_shape``,
    ``scale``, ``scale_block``, ``scaling_ops`` (how many of ``ops`` the
    in-flight and scale groups use), ``budget``, ``warmup``, ``min_iters``) and
    the ``Plan`` fields ``max_iters``, ``timeout`` and ``rotate``; ``None`` keeps the default."""
    base = QUICK if quick else FULL
    unknown = set(overrides) - set(base) - {"max_iters", "timeout", "rotate"}
    if unknown:
        raise InvalidArgument(f"unknown plan settings {sorted(unknown)}; valid: {sorted(base)}")
    s = {**base, **{k: v for k, v in overrides.items() if v is not None}}
    bad = [g for g in groups if g not in GROUPS]
    if bad or not groups:
        raise InvalidArgument(f"groups must be among {list(GROUPS)}, got {list(groups)}")
    try:
        ops = [Op(o.upper() if isinstance(o, str) else o) for o in ops]
    except ValueError:
        raise InvalidArgument(f"ops must be READ and/or WRITE, got {list(ops)}") from None
    if not ops:
        raise InvalidArgument("ops must be READ and/or WRITE, got none")
    blocks, batches = _positive(s["blocks"], "block sizes"), _positive(s["batches"], "batch sizes")
    ib, ibatch = (int(v) for v in s["inflight_shape"])
    scale_block = int(s["scale_block"])
    if min(ib, ibatch, scale_block) <= 0:
        raise InvalidArgument(f"block shapes must be positive, got inflight_shape={s['inflight_shape']}, "
                              f"scale_block={scale_block}")
    cases: list[Case] = []
    if "sweep" in groups:
        cases += [Case("sweep", op, b, n) for b in blocks for n in batches if b * n <= s["max_bytes"] for op in ops]
    if "inflight" in groups:
        cases += [Case("inflight", op, ib, ibatch, k)
                  for k in _positive(s["inflight"], "in-flight counts") for op in ops[:s["scaling_ops"]]]
    if "scale" in groups:
        cases += [Case("scale", op, scale_block, n)
                  for n in _positive(s["scale"], "scaling block counts") for op in ops[:s["scaling_ops"]]]
    if not cases:
        raise InvalidArgument(f"the plan is empty: no block size x batch fits max_bytes={s['max_bytes']}")
    for name in ("budget", "timeout"):  # finite: an endless wait is no measurement (and inf is no JSON)
        if name in s and not 0 < s[name] <= MAX_SECONDS:
            raise InvalidArgument(f"{name} must be a positive number of seconds, at most {MAX_SECONDS:g}, "
                                  f"got {s[name]}")
    max_iters = s.get("max_iters", Plan.max_iters)
    if not (0 <= s["warmup"] <= max_iters and 1 <= s["min_iters"] <= max_iters):
        raise InvalidArgument(f"warmup must be in 0..{max_iters} and min_iters in 1..{max_iters} (max_iters), "
                              f"got {s['warmup']}, {s['min_iters']}")
    if s.get("rotate", 0) < 0:
        raise InvalidArgument(f"rotate must be a size >= 0 (0: the same blocks every iteration), got {s['rotate']}")
    timing = {k: s[k] for k in ("budget", "warmup", "min_iters", "max_iters", "timeout", "rotate") if k in s}
    meta = {"quick": quick, "groups": list(groups), "ops": [o.value for o in ops], "max_bytes": s["max_bytes"]}
    return Plan(cases=tuple(cases), meta=meta, **timing)
