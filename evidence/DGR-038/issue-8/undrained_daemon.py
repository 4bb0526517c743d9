"""The slow-reader drill against daemons whose transport never waits for its write buffer to drain (the
test tests/test_stress.py::test_slow_reader_drill_fails_against_a_daemon_without_backpressure, with its
report printed): the drill must fail there. Run from the repository root:
    .venv/bin/python evidence/DGR-038/issue-8/undrained_daemon.py
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))

import kvpool.stress  # noqa: E402
import tests.test_stress as test  # noqa: E402
from kvpool.bundled import bundled_model_path  # noqa: E402


def run_and_print(options, **kwargs):
    report = kvpool.stress.run_stress(options, **kwargs)
    print(kvpool.stress.render(report))
    return report


test.run_stress = run_and_print
test.test_slow_reader_drill_fails_against_a_daemon_without_backpressure(pathlib.Path("/tmp"), bundled_model_path())
print("the test's assertions held: the slow_reader verdict failed against the daemons without backpressure")
