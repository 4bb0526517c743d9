"""Section 7 at each length from stop 48's bench JSONs: park + the decode that restores on each daemon in turn, and
park + Restore on all at once + the decode. From 3e85f0e the first keeps the headline's keys (s7_park_*,
s7_restore_decode_*, ...) and the second is s7_request_*; on 5af1ef9 and 291744c the headline's keys held Restore
first and s7_append_* the decode that restores."""
import json, sys
for path in sys.argv[1:]:
    d = json.load(open(path)); s = d["summary"]
    print(path.rsplit("/", 1)[-1], "other cores", round(d["load"]["warm"]["other_cores"], 4))
    early = "s7_request_call_128_s" not in s
    plain, first, call = ("append_", "", "restore_call") if early else ("", "request_", "request_call")
    for L in (128, 512, 2048):
        g = lambda k: s[f"s7_{k}_{L}_s"] * 1e3
        print(f"  {L}: decode restores: park {g(plain + 'park'):.2f} restoring decode {g(plain + 'restore_decode'):.2f} "
              f"total {g(plain + 'park_and_restore'):.2f} -> {s[f's7_{plain}restore_vs_reprefill_{L}']:.1f}x | Restore first: park {g(first + 'park'):.2f} "
              f"Restore {g(call):.2f} Restore + decode {g(first + 'restore_decode'):.2f} total {g(first + 'park_and_restore'):.2f} "
              f"-> {s[f's7_{first}restore_vs_reprefill_{L}']:.1f}x | hot {g('hot_decode'):.2f} re-prefill {g('reprefill'):.0f}")
