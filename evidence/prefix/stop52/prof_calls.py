"""Per-call cumulative times of the admission and restore steps in the three supervisors' profiles (cProfile
files in the directories named), summed over the three daemons: python prof_calls.py DIR..."""
import glob, pstats, sys
NAMES = ("admit", "read", "add_parked", "seal", "restore", "restore_now", "_unpark", "take_blob", "prepared_state", "restore_with_append", "written", "write_state")
for directory in sys.argv[1:]:
    totals = {}
    for f in sorted(glob.glob(f"{directory}/prof.*")):
        for (file, line, name), (cc, nc, tt, ct, callers) in pstats.Stats(f).stats.items():
            short = file.split("/")[-1]
            if name in NAMES and short in ("prefix.py", "prefixes.py", "books.py", "warm.py", "sealing.py", "admission.py", "pipe.py", "handle.py", "shared.py", "sequence.py", "header.py"):
                calls, cum = totals.get(f"{short}:{name}", (0, 0.0))
                totals[f"{short}:{name}"] = (calls + nc, cum + ct)
    print("==", directory)
    for key, (calls, cum) in sorted(totals.items(), key=lambda item: -item[1][1]):
        if cum > 0.01:
            print(f"  {key:32s} calls {calls:4d}  per call {cum / calls * 1e3:7.2f} ms")
