"""``kvt bench``: every backend side by side, against memcpy and raw NIXL.

::

    plan = make_plan(quick=True)
    out = run_engine(EngineSpec("host", "kvt", load_config("host")), plan)
    rows = add_ratios(merge_rounds(out.rows))

Modules, one job each: ``plan`` (the cases and the timing policy),
``buffers`` (arenas in kvt shared memory), ``timing`` (the one timed loop
every engine runs through), ``stats`` (rows, ratios, growth), ``runner``
(initiator and target in fresh processes per engine), ``report`` (table,
JSON, plot); the engines: ``agent_engine`` (a kvt backend through
``kvt.Agent``), ``memcpy`` and ``raw_nixl`` (the baselines).  The command
line is ``kvt.commands.bench``; docs/performance.md explains every figure.
"""

from .plan import GROUPS, Case, Plan, format_size, make_plan, parse_size
from .runner import EngineSpec, Outcome, check_configs, run_engine
from .stats import MEMCPY, RAW_NIXL, add_ratios, growth, merge_rounds, summarize

__all__ = ["GROUPS", "Case", "Plan", "make_plan", "parse_size", "format_size", "EngineSpec", "Outcome",
           "check_configs", "run_engine", "MEMCPY", "RAW_NIXL", "add_ratios", "growth", "merge_rounds", "summarize"]
