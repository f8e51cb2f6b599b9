"""Result rows: statistics of one case, ratios to the baselines, growth.

A row is a plain dict (it goes to JSON as is)::

    engine, group, op, block, batch, inflight, bytes   what was measured
    iters                 timed iterations
    gbps                  bytes / median latency / 1e9
    median_s, p99_s       latency of one iteration (post + completion)
    min_s
    post_s, complete_s    medians of the two parts of an iteration
    cpu_s                 median CPU seconds the initiator process used per request
    x_memcpy, x_raw_nixl  gbps / the baseline's gbps for the same case (or None)
    error                 None, or why the case failed (then the numbers are None)
    samples               per-iteration post and completion times, until
                          ``merge_rounds`` has pooled them (dropped from reports)
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from ..types import Op
from .plan import Case

__all__ = ["MEMCPY", "RAW_NIXL", "summarize", "failed", "merge_rounds", "add_ratios", "growth", "row_key"]

#: engine names of the baselines
MEMCPY, RAW_NIXL = "memcpy", "raw-nixl"
_NUMBERS = ("iters", "gbps", "median_s", "p99_s", "min_s", "post_s", "complete_s", "cpu_s")


def summarize(engine: str, case: Case, post: Sequence[float], complete: Sequence[float],
              cpu: Sequence[float] | None = None) -> dict:
    """The row for ``case`` from per-iteration post and completion times (seconds)."""
    post_a, done_a = np.asarray(post, float), np.asarray(complete, float)
    if post_a.size == 0 or post_a.shape != done_a.shape:
        raise ValueError(f"need equally many post and completion times, got {post_a.size} and {done_a.size}")
    lat = post_a + done_a
    median = float(np.median(lat))
    return {"engine": engine, **case.as_dict(), "iters": int(lat.size),
            "gbps": case.nbytes / median / 1e9 if median > 0 else float("inf"),
            "median_s": median, "p99_s": float(np.percentile(lat, 99)), "min_s": float(lat.min()),
            "post_s": float(np.median(post_a)), "complete_s": float(np.median(done_a)),
            "cpu_s": float(np.median(cpu)) if cpu else None, "error": None,
            "samples": {"post": post_a.tolist(), "complete": done_a.tolist(), "cpu": list(cpu or [])}}


def failed(engine: str, case: Case, error: str) -> dict:
    """The row of a case that could not be measured."""
    return {"engine": engine, **case.as_dict(), **dict.fromkeys(_NUMBERS), "error": error}


def row_key(row: dict) -> tuple:
    return (row["group"], row["op"], row["block"], row["batch"], row["inflight"])


def merge_rounds(rows: Iterable[dict]) -> list[dict]:
    """One row per engine and case, without samples: the iterations of every
    round pooled and summarised again (``rounds`` says how many).  A case that
    failed in any round keeps that round's error."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["engine"], row_key(r)), []).append(r)
    out = []
    for (engine, key), rs in groups.items():
        bad = [r for r in rs if r["error"]]
        if bad:
            merged = bad[0]
        else:
            case = Case(key[0], Op(key[1]), *key[2:])
            merged = summarize(engine, case, [t for r in rs for t in r["samples"]["post"]],
                               [t for r in rs for t in r["samples"]["complete"]],
                               [t for r in rs for t in r["samples"].get("cpu", [])])
        out.append({**{k: v for k, v in merged.items() if k != "samples"}, "rounds": len(rs)})
    return out


def add_ratios(rows: Iterable[dict]) -> list[dict]:
    """Copies of ``rows`` with ``x_memcpy`` and ``x_raw_nixl``: the row's
    bandwidth over the baseline's for the same case (None when either is missing)."""
    rows = list(rows)
    base = {name: {row_key(r): r["gbps"] for r in rows if r["engine"] == name and r["gbps"]}
            for name in (MEMCPY, RAW_NIXL)}

    def ratio(r: dict, name: str) -> float | None:
        b = base[name].get(row_key(r))
        return r["gbps"] / b if r["gbps"] and b else None

    return [{**r, "x_memcpy": ratio(r, MEMCPY), "x_raw_nixl": ratio(r, RAW_NIXL)} for r in rows]


def growth(rows: Iterable[dict]) -> list[dict]:
    """How time grows with blocks per transfer (the ``scale`` rows), per
    engine and op: median latency at each block count, the factors from the
    fewest to the most blocks (None for a single count), and microseconds per
    block at the most."""
    series: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if r["group"] == "scale" and r["median_s"]:
            series.setdefault((r["engine"], r["op"]), []).append(r)
    out = []
    for (engine, op), rs in series.items():
        rs.sort(key=lambda r: r["batch"])
        first, last = rs[0], rs[-1]
        several = len(rs) > 1
        out.append({"engine": engine, "op": op, "block": last["block"],
                    "median_s": {r["batch"]: r["median_s"] for r in rs},
                    "blocks_factor": last["batch"] / first["batch"] if several else None,
                    "time_factor": last["median_s"] / first["median_s"] if several else None,
                    "us_per_block": last["median_s"] / last["batch"] * 1e6})
    return out
