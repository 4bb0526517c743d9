"""One line per run of run_matrix.sh, from its --json file: python evidence/DGR-038/issue-8/summarize.py"""

import collections
import pathlib
import sys

import msgspec

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
from kvpool.stress import StressReport  # noqa: E402

folder = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent
print(f"{'SCENARIO':<16} {'SEED':>4} {'RESULT':<6} {'SECONDS':>7} {'ROWS=':>5} {'LANDED d0/d1/d2':>15} {'LATE':>4} {'WARN':>4}  DRILL")
for scenario in ("default", "budget-for-2", "ttl-1", "kill-worker", "kill-supervisor", "stall-worker", "slow-reader"):
    for seed in (0, 1, 2):
        path = folder / f"stress-{scenario}-seed{seed}.json"
        report = msgspec.json.decode(path.read_bytes(), type=StressReport)
        landed = collections.Counter()
        for session in report.sessions:
            landed.update({int(k): v for k, v in session.cancels_landed_on.items()})
        drill = ""
        if report.supervisor_kills:
            kill = report.supervisor_kills[0]
            lost = sum(1 for s in report.sessions if s.connection_losses)
            drill = (f"daemon {kill.daemon}: {len(kill.descendants)} processes gone in {kill.all_gone_s} s, {len(kill.segments)} segments removed, "
                     f"restart {kill.restart_s} s, {lost} sessions lost their connection and replayed")
        elif report.stalls:
            stall = report.stalls[0]
            drill = f"daemon {stall.daemon}: {stall.reply} after {stall.elapsed_s} s (timeout {stall.timeout_s:g} s), worker gone {stall.worker_gone}"
        elif report.slow_reader is not None:
            slow = report.slow_reader
            drill = (f"{slow.appends_sent}/{slow.appends_planned} sent, {slow.appends_processed} executed, "
                     f"RSS +{(slow.rss_max_bytes - slow.rss_before_bytes) / 2**20:.1f} MiB (bound {slow.bound_bytes / 2**20:.0f})")
        elif report.kills:
            kill = report.kills[0]
            drill = f"daemon {kill.daemon}: {kill.reply}"
        elif scenario == "budget-for-2":
            drill = f"evictions {[d.counters.get('evictions', 0) for d in report.daemons]}"
        elif scenario == "ttl-1":
            drill = f"expirations {[d.counters.get('expirations', 0) for d in report.daemons]}"
        rows = sum(s.checked_rows for s in report.sessions)
        print(f"{scenario:<16} {seed:>4} {'PASS' if report.passed else 'FAIL':<6} {report.duration_s:>7.1f} {rows:>5} "
              f"{'/'.join(str(landed[i]) for i in range(3)):>15} {sum(s.late_cancels for s in report.sessions):>4} {len(report.warnings):>4}  {drill}")
