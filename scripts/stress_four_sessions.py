#!/usr/bin/env python3
"""Four concurrent sessions (by default) through a 3-shard chain of `kvpool serve` daemons, with fault
drills and a bit-exact comparison against each session run alone. Same as `kvpool stress`; see --help.

    python scripts/stress_four_sessions.py                    # the default four-session run
    python scripts/stress_four_sessions.py --budget-for 2     # LRU eviction under a two-session budget
    python scripts/stress_four_sessions.py --ttl 1            # idle sessions expire
    python scripts/stress_four_sessions.py --kill-worker      # one worker SIGKILLed mid-decode
    python scripts/stress_four_sessions.py --kill-supervisor  # one daemon's supervisor SIGKILLed, restarted on its socket
    python scripts/stress_four_sessions.py --stall-worker     # one worker SIGSTOPped past the daemon's --request-timeout
    python scripts/stress_four_sessions.py --slow-reader      # one connection sends appends and never reads a reply
    python scripts/stress_four_sessions.py --sessions 8 --ops 200 --json out.json
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # run from a clone without installing

from kvpool.stress.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
