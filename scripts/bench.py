"""kvpool side by side with llama.cpp (issue 5); the same as `kvpool bench`. See kvpool/bench/.

Usage: python scripts/bench.py [--quick] [--out DIR]
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from kvpool.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
