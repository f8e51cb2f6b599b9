"""Showing results: the table (terminal and markdown), the growth table,
the JSON document and the bandwidth plot.  Rows are those of ``stats``."""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path
from typing import Iterable, Sequence

from rich import box
from rich.table import Table

from .plan import Plan, format_size
from .stats import MEMCPY, RAW_NIXL, growth, row_key

__all__ = ["SCHEMA", "HEADERS", "cells", "table", "growth_table", "markdown", "document", "write_json",
           "plot", "ordered", "machine", "write_text"]

SCHEMA = "kvt-bench/1"
HEADERS = ["group", "op", "block", "batch", "in flight", "engine", "GB/s", "median", "p99",
           "post", "complete", "CPU/req", "x memcpy", "x raw NIXL", "iters"]  # iters: pooled over the rounds
_RIGHT = set(HEADERS[2:5] + HEADERS[6:])


def fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def ordered(rows: Iterable[dict], plan: Plan, engines: Sequence[str]) -> list[dict]:
    """Rows in plan order, each case's engines in ``engines`` order."""
    case_pos = {c.key: i for i, c in enumerate(plan.cases)}
    eng_pos = {e: i for i, e in enumerate(engines)}
    return sorted(rows, key=lambda r: (case_pos.get(row_key(r), len(case_pos)), eng_pos.get(r["engine"], len(eng_pos))))


def cells(r: dict) -> list[str]:
    """One row as the table's text cells (``HEADERS`` order)."""
    head = [r["group"], r["op"], format_size(r["block"]), str(r["batch"]), str(r["inflight"]), r["engine"]]
    if r["error"]:
        return head + ["failed"] + ["-"] * 8
    return head + [_num(r["gbps"]), fmt_time(r["median_s"]), fmt_time(r["p99_s"]), fmt_time(r["post_s"]),
                   fmt_time(r["complete_s"]), fmt_time(r.get("cpu_s")), _num(r.get("x_memcpy")), _num(r.get("x_raw_nixl")), str(r["iters"])]


def table(rows: Sequence[dict], title: str = "kvt bench") -> Table:
    t = Table(title=title, box=box.SIMPLE_HEAD)
    for h in HEADERS:
        t.add_column(h, justify="right" if h in _RIGHT else "left", no_wrap=True)
    for i, r in enumerate(rows):
        nxt = rows[i + 1] if i + 1 < len(rows) else None
        same_case = nxt is not None and row_key(nxt) == row_key(r)
        style = "bold" if r["engine"] not in (MEMCPY, RAW_NIXL) else "dim"
        t.add_row(*cells(r), style="red" if r["error"] else style, end_section=not same_case)
    return t


_GROWTH_HEADERS = ["engine", "op", "block"]


def _growth_cells(rows: Sequence[dict]) -> tuple[list[str], list[list[str]]]:
    g = growth(rows)
    counts = sorted({n for s in g for n in s["median_s"]})
    headers = _GROWTH_HEADERS + [f"{n:,} blocks" for n in counts] + ["time growth", "us/block"]
    body = [[s["engine"], s["op"], format_size(s["block"])] + [fmt_time(s["median_s"].get(n)) for n in counts]
            + ["-" if s["time_factor"] is None else f"x{s['time_factor']:.1f} for x{s['blocks_factor']:.0f} blocks",
               f"{s['us_per_block']:.2f}"]
            for s in g]
    return headers, body


def growth_table(rows: Sequence[dict]) -> Table | None:
    headers, body = _growth_cells(rows)
    if not body:
        return None
    t = Table(title="time vs blocks per transfer (median latency)", box=box.SIMPLE_HEAD)
    for h in headers:
        t.add_column(h, justify="left" if h in _GROWTH_HEADERS else "right", no_wrap=True)
    for b in body:
        t.add_row(*b)
    return t


def _md(headers: list[str], body: list[list[str]], right: set[str]) -> str:
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---:" if h in right else "---" for h in headers) + "|"]
    lines += ["| " + " | ".join(b) + " |" for b in body]
    return "\n".join(lines)


def markdown(rows: Sequence[dict], engines: Sequence[str]) -> str:
    """GitHub markdown: the side-by-side table (one line per case, GB/s of
    every engine with its ratios to memcpy and raw NIXL), the growth table,
    and every row in full inside a ``<details>`` block."""
    keys = list(dict.fromkeys(row_key(r) for r in rows))
    by = {(row_key(r), r["engine"]): r for r in rows}
    baselines = {MEMCPY, RAW_NIXL}
    headers = HEADERS[:5] + [f"{e} GB/s" + ("" if e in baselines else " (x memcpy, x raw)") for e in engines]

    def cell(r: dict | None, engine: str) -> str:
        if r is None:
            return "-"
        if r["error"]:
            return "failed"
        ratios = "" if engine in baselines else f" ({_num(r.get('x_memcpy'))}, {_num(r.get('x_raw_nixl'))})"
        return f"{r['gbps']:.2f}{ratios}"

    wide = [cells(next(r for r in rows if row_key(r) == k))[:5] + [cell(by.get((k, e)), e) for e in engines]
            for k in keys]
    out = _md(headers, wide, set(headers[2:]))
    g_headers, g_body = _growth_cells(rows)
    if g_body:
        out += "\n\n" + _md(g_headers, g_body, set(g_headers) - set(_GROWTH_HEADERS))
    out += ("\n\n<details><summary>every row: latency, post and completion times</summary>\n\n"
            + _md(HEADERS, [cells(r) for r in rows], _RIGHT) + "\n\n</details>")
    return out


def machine() -> dict:
    """What the numbers were measured on."""
    return {"hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "loadavg": list(os.getloadavg())}


def document(plan: Plan, outcomes: Sequence, rows: Sequence[dict], *, argv: Sequence[str], options: dict,
             rounds: int, started: float, finished: float, machine_before: dict) -> dict:
    """The JSON document (``SCHEMA``); keys are stable."""
    from .. import __version__
    return {"schema": SCHEMA, "kvt_version": __version__, "argv": list(argv), "options": options,
            "started": started, "finished": finished,
            "machine": {**machine_before, "loadavg_after": list(os.getloadavg())},
            "plan": {**plan.describe(), "rounds": rounds},
            "engines": [{"name": o.spec.name, "kind": o.spec.kind,
                         "backend": o.spec.config.backend if o.spec.kind == "kvt" else None,
                         "status": o.status, "reason": o.reason} for o in outcomes],
            "results": list(rows), "growth": growth(rows)}


def write_text(path: str | os.PathLike, text: str) -> None:
    Path(path).write_text(text.rstrip("\n") + "\n")


def _finite(x):
    """``x`` with every non-finite float replaced by None: JSON has no Infinity or NaN."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_json(path: str | os.PathLike, doc: dict) -> None:
    """``doc`` as strict JSON (a non-finite number, e.g. the bandwidth of a zero latency, is null)."""
    write_text(path, json.dumps(_finite(doc), indent=1, allow_nan=False))


def plot(rows: Sequence[dict], path: str | os.PathLike, engines: Sequence[str]) -> None:
    """Bandwidth vs block size, one panel per op, one line per engine (memcpy
    black dashed, raw NIXL grey).  Each point is the largest batch measured
    for that block size in the ``sweep`` group."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = [r for r in rows if r["group"] == "sweep" and r["gbps"]]
    ops = sorted({r["op"] for r in sweep})
    if not ops:
        from ..errors import InvalidArgument
        raise InvalidArgument("nothing to plot: no sweep row was measured")
    fig, axes = plt.subplots(1, len(ops), figsize=(5.2 * len(ops), 3.6), sharey=True, squeeze=False)
    styles = {MEMCPY: dict(color="black", linestyle="--", linewidth=2),
              RAW_NIXL: dict(color="0.5", linestyle="-.", marker="s", markersize=3)}
    blocks = sorted({r["block"] for r in sweep})
    for ax, op in zip(axes[0], ops):
        for engine in engines:
            best: dict[int, dict] = {}
            for r in sweep:
                if r["engine"] == engine and r["op"] == op and r["batch"] >= best.get(r["block"], {"batch": 0})["batch"]:
                    best[r["block"]] = r
            if best:
                xs = sorted(best)
                ax.plot(xs, [best[x]["gbps"] for x in xs], label=engine,
                        **styles.get(engine, dict(marker="o", markersize=4)))
        ax.set_xscale("log", base=2)
        ax.set_xticks(blocks, [format_size(b) for b in blocks], fontsize=8)
        ax.minorticks_off()
        ax.set_title(op, fontsize=10)
        ax.set_xlabel("block size (largest batch measured)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("GB/s")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle("kvt bench: bandwidth vs block size, initiator and target in two processes", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
