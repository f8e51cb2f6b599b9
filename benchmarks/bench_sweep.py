"""The full ``kvt bench`` sweep as a script (same flags as ``kvt bench``).

    python benchmarks/bench_sweep.py --json perf.json --plot docs/perf-sweep.png
    python benchmarks/bench_sweep.py --quick --backend host

Every usable backend and raw NIXL run an initiator and a target in two
processes each, next to a memcpy of the same blocks; see
docs/performance.md.  The code lives in ``kvt.bench``.
"""

from __future__ import annotations

import sys

from kvt.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
