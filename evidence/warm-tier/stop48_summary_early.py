"""Section 7 at each length, from the bench JSONs of 5af1ef9 and 291744c, whose headline keys (s7_restore_decode_*,
s7_park_and_restore_*, s7_restore_vs_reprefill_*) held Restore first + the decode, and s7_append_* the decode that
restores on each daemon in turn (3e85f0e put the keys back: stop48_summary.py)."""
import json, sys
for path in sys.argv[1:]:
    d = json.load(open(path)); s = d["summary"]
    print(path.rsplit("/", 1)[-1], "other cores", round(d["load"]["warm"]["other_cores"], 4))
    for L in (128, 512, 2048):
        g = lambda k: s[f"s7_{k}_{L}_s"] * 1e3
        print(f"  {L}: decode restores: park {g('append_park'):.2f} restoring decode {g('append_restore_decode'):.2f} total {g('append_park_and_restore'):.2f} "
              f"-> {s[f's7_append_restore_vs_reprefill_{L}']:.1f}x | Restore first: park {g('park'):.2f} Restore {g('restore_call'):.2f} "
              f"Restore + decode {g('restore_decode'):.2f} total {g('park_and_restore'):.2f} -> {s[f's7_restore_vs_reprefill_{L}']:.1f}x "
              f"| hot {g('hot_decode'):.2f} re-prefill {g('reprefill'):.0f}")
