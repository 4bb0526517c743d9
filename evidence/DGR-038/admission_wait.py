"""Does an admission waiting for room (admit_timeout_s) get it as soon as a busy session turns idle?

One daemon on the whole bundled model with a budget for one session: session A runs a long prefill, B asks
to be admitted with admit_timeout_s 20 while A is busy. A is evictable the moment its append ends.

    .venv/bin/python evidence/DGR-038/admission_wait.py
"""

import pathlib, tempfile, threading, time
from kvpool.launcher import start_daemons
from kvpool.bundled import bundled_model_path
from kvpool.tokenizer import Tokenizer
model = bundled_model_path()
with Tokenizer(model) as t:
    long_prompt = t.encode(" ".join(f"word{i}" for i in range(900)))[:1500]
d = pathlib.Path(tempfile.mkdtemp(prefix="kvadm-", dir="/tmp"))
# probe the charge, then a budget that holds exactly one session
[probe] = start_daemons([model], d, ["--threads", "1", "--n-ctx", "2048", "--max-sessions", "1"], prefix="probe")
with probe.client() as c:
    c.append("p", 1, 0, tokens=[1, 2]); charge = c.stats().sessions[0].charged_bytes
probe.stop()
[daemon] = start_daemons([model], d, ["--threads", "1", "--n-ctx", "2048", "--max-sessions", "2", "--budget", str(charge + charge // 2)])
try:
    with daemon.client() as a, daemon.client() as b:
        a.append("A", 1, 0, tokens=long_prompt[:10])
        done = {}
        def busy():
            started = time.monotonic(); a.append("A", 1, 10, tokens=long_prompt[10:]); done["A_busy_s"] = time.monotonic() - started
        th = threading.Thread(target=busy); th.start()
        while not b.stats().sessions[0].in_flight: time.sleep(0.005)
        started = time.monotonic()
        r = b.append("B", 1, 0, tokens=[1, 2], admit_timeout_s=20.0)
        waited = time.monotonic() - started
        th.join()
        print(f"A's append kept it busy for {done['A_busy_s']:.2f} s; B admitted={r.admitted} after waiting {waited:.2f} s (admit_timeout_s 20)")
        print("counters:", {k: v for k, v in b.stats().counters.items() if k in ("evictions", "over_budget_rejects", "admissions")})
finally:
    daemon.stop()
