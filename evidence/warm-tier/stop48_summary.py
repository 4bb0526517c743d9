"""Section 7 at each length, from bench JSONs of stop 48's code (291744c and after: request_* keys)."""
import json, sys
for path in sys.argv[1:]:
    d = json.load(open(path)); s = d["summary"]
    print(path.rsplit("/", 1)[-1], "other cores", round(d["load"]["warm"]["other_cores"], 4))
    for L in (128, 512, 2048):
        g = lambda k: s[f"s7_{k}_{L}_s"] * 1e3
        print(f"  {L}: decode restores: park {g('park'):.2f} restoring decode {g('restore_decode'):.2f} total {g('park_and_restore'):.2f} "
              f"-> {s[f's7_restore_vs_reprefill_{L}']:.1f}x | Restore first: park {g('request_park'):.2f} Restore {g('request_call'):.2f} "
              f"Restore + decode {g('request_restore_decode'):.2f} total {g('request_park_and_restore'):.2f} -> {s[f's7_request_restore_vs_reprefill_{L}']:.1f}x "
              f"| hot {g('hot_decode'):.2f} re-prefill {g('reprefill'):.0f}")
