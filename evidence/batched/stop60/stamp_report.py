import json, sys, statistics as st
s = sorted(json.load(open(sys.argv[1])), key=lambda x: x[1])
sends = [i for i, (k, _t) in enumerate(s) if k == "send"]
rows = []
for a, b in zip(sends, sends[1:]):
    seg = s[a:b + 1]
    kinds = [k for k, _ in seg]
    if kinds.count("done") != 1 or kinds.count("reply") != 4 or kinds.count("req") != 4:
        continue
    t = lambda kind: [x for k, x in seg if k == kind]
    send0, done = seg[0][1], t("done")[0]
    replies, reqs, send1 = t("reply"), t("req"), seg[-1][1]
    if not (done < min(replies) and max(replies) <= max(reqs)):
        continue
    rows.append({
        "worker (RunBatch sent -> BatchDone)": done - send0,
        "fan-out (BatchDone -> 4th reply written)": max(replies) - done,
        "first reply -> first next request": min(reqs) - min(replies),
        "first -> 4th request": max(reqs) - min(reqs),
        "4th request -> next RunBatch sent": send1 - max(reqs),
        "step (RunBatch to RunBatch)": send1 - send0,
    })
print(f"{len(rows)} steps of 4 (of {len(sends)} batches); medians in us")
for key in rows[0]:
    v = [r[key] / 1000 for r in rows]
    print(f"  {key:45s} med {st.median(v):9.1f}  p10 {sorted(v)[len(v)//10]:9.1f}  p90 {sorted(v)[9*len(v)//10]:9.1f}")
import glob
for path in glob.glob(sys.argv[1] + ".worker*"):
    w = json.load(open(path))
    runs, decs, cur = [], [], None
    i = 0
    for k, t in w:
        if k == "run<": cur = {"start": t, "dec": 0, "n": 0}
        elif k == "dec<" and cur is not None: d0 = t
        elif k == "dec>" and cur is not None: cur["dec"] += t - d0; cur["n"] += 1
        elif k == "run>" and cur is not None: cur["end"] = t; runs.append(cur); cur = None
    full = [r for r in runs if r["n"] == 1]
    print(f"worker {path}: {len(runs)} RunBatch, {len(full)} with one llama_decode")
    tot = [(r["end"] - r["start"]) / 1000 for r in full]; dec = [r["dec"] / 1000 for r in full]
    print(f"  handle(RunBatch) med {st.median(tot):9.1f} us; llama_decode med {st.median(dec):9.1f} us; rest med {st.median([a-b for a,b in zip(tot,dec)]):7.1f} us")
