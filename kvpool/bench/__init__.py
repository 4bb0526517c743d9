"""`kvpool bench`: kvpool side by side with llama.cpp on the bundled model, as ratios measured in one run.

Sections (issue 5), each comparing variants interleaved round by round in one run (the machine is shared
and noisy: compare the ratios, not the absolute times; every figure is a median):

  1 daemon overhead, one session   middle-shard decode through a daemon / the worker runtime in-process /
                                   llama.cpp in-process without capture / the shard in a process with no
                                   kvpool code (kvpool.bench.relay): what serving it from another process
                                   costs here, and the daemon against that (kvpool's own cost)
  2 whole route, one session       greedy decode through a chain of 3 shard daemons / the whole model in one
                                   llama.cpp context (or its 3 shards in one process, where they were faster),
                                   and where the difference goes, from measured components; the same 3 shards
                                   relayed through 3 processes with no kvpool code: the floor of any route of
                                   processes here, and the daemons against it
                                   (sections 1 and 2: the variants take turns every 3 timed steps)
  3 four sessions at once          aggregate decode tok/s through kvpool / llama.cpp serving the four as
                                   sequences of one context with one batched llama_decode per step
  4 prefill                        512 rows into the middle shard through a daemon / in-process
                                   (`--only decode` runs sections 1, 2 and 4 alone, on the daemons they use)
  5 admission and reclaim          admit on a warm worker (into the context a release left) / a bare llama context; release; LRU eviction
  6 memory                         bytes charged / theoretical KV / a worker's USS over its start-up; daemon USS
  7 warm tier                      through 3 shard daemons of their own (--n-ctx 2112): Park on all 3 at once
                                   (as a router parks a route) + the 1-token decode that restores on each
                                   right after (in place: the cells the park left in its spare), 5 cycles
                                   per round, and 2 more whose restore comes 1.3 s later (the spares zeroed:
                                   the state loaded from the store) / a fresh session's prefill + the same
                                   decode (what a cache miss costs), at 128, 512, 2048 tokens (quick: 128,
                                   512);
                                   sessions per GiB parked (spill bytes) / hot (charged bytes), 256 tokens at
                                   n_ctx 2048 (`--only warm` runs this section alone)
  8 overload                       8 sessions at once through a 3-daemon chain with 2 places per daemon /
                                   the same 8 sessions run 2 at a time by the router (`--overload-only`
                                   runs this section alone); whether the daemons have the warm tier
  9 start-up                       `kvpool serve` to its first status on the middle shard at --n-ctx 512,
                                   2048, 8192, a first start (nothing kept: the probe runs) / a bare llama
                                   context of that n_ctx; a first start at 8192 / at 2048 (flat: 1.0; the
                                   probe fills 2048 cells in both) and at 8192 / at 512; a restart (the
                                   probe's readings kept) at 8192 against 1.5 x a restart at 512 + 1 s and
                                   against the shard's model load in process + 2 s
 10 durable sessions               one daemon of the first shard with --spill-dir, started and drained (SIGTERM)
                                   on one socket and spill dir: the drain (SIGTERM to exit 0) with N parked
                                   sessions / with none; `kvpool serve` to its first answered Hello adopting
                                   the N / with nothing to adopt (N: 8, quick 4, --durable-sessions); the
                                   first append after a restart (1 token, restored from the disk tier,
                                   `restored: true`) / a fresh session's prefill of the same history + that
                                   token, at 512 and 2048 tokens (`--only durable` runs this section alone)
 11 move vs replay                 a session on the 3-shard route (0:10,10:20,20:30 on the bundled model)
                                   re-planned onto 2 shards cut elsewhere (0:14,14:30) by Router.replan
                                   (export, re-slice, import under epoch + 1) + its next append / the same
                                   history appended on the new route from 0 + that append, at 128, 512, 2048
                                   tokens (quick: 128, 512), with the bytes moved and whether the next
                                   logits are bit-identical (`--only move` runs this section alone)
 12 shared prefixes                through 3 shard daemons of their own (--n-ctx 2048, --prefix-block 32): a new
                                   session's time to first token, its prompt a 1,024-token system prompt an
                                   earlier session stored + a 32-token message of its own, Router(clients) /
                                   Router(clients, prefix_cache=False) (1,056 rows prefilled) / llama.cpp in
                                   one process, the whole model, 1 thread, one context kept across requests as
                                   its server keeps a slot's (llama_state_seq_set_data of the system prompt's
                                   saved state, then the 32 rows; also with a context created per request),
                                   where the time goes (lookup, admission, restore, the rows, per daemon), and
                                   the memory of 4 sessions sharing the prefix, --mode process / batched (budget
                                   reserved, workers' USS, the prefix store's bytes); 7 rounds (quick 3,
                                   --prefix-rounds); `--only prefix` runs this section alone

Threads: every single-session figure uses 1 llama thread per computing context (kvpool's default
--threads-per-worker); `--only decode --threads N` runs sections 1, 2 and 4 at N on both sides (the daemons'
--threads and --threads-per-worker, the in-process references'), where llama.cpp may decode one session faster
(1.7x at 2 threads on a 2-core Xeon at ~1B). The daemons' idle threads spin as their --idle-spin default says
(workers.server.spin); the in-process references keep libgomp's own default, no slower alone. Four sessions: llama.cpp batched uses 2 threads; the whole-model daemon runs
`--threads 2 --threads-per-worker 1` (at most 2 workers compute at once); the chain's three daemons run
`--threads 1` each, which alone would allow 3 single threads at once across daemons, so the benchmark's
router caps the chain at 2 appends in flight (at most 2 llama threads); an uncapped chain row is shown too.
Flash attention is off everywhere. Greedy decoding continues past end-of-generation tokens (timing only).
Memory: the daemons run with --huge-pages auto, their default (workers.runtime.huge_pages), and every in-process
reference loads its model the same way (workers.runtime.model.ShardModel's default), so neither side of a ratio
has huge pages the other lacks (JSON "environment": transparent_huge_pages, the bench's huge_page_bytes_at_end).
Spinners: the daemons of sections 1-5 run `--keep-warm 1` (kvpool serve's default is 0, off: kvpool.daemon.keep_warm;
the bench's --keep-warm SECONDS sets it, 0 to compare without), keeping their CPUs awake for a second after each
session request with idle-priority spinners, one a CPU, as a machine given to the route would; their CPU time is the
bench's own (its process tree), not the other processes' it checks; the in-process references run beside them (at idle priority a spinner yields its CPU, but a slowing of the references
by up to ~1% was not ruled out: evidence/daemon-overhead/README.md, "Stop 49"). Sections 7-12 run the default.

The JSON's "ratios" names the headline ratios, each with its target (null: none), whether it was met and its
verdict. The bench checks its own runs (kvpool.bench.checks): each section's load (JSON "load": load
averages at its start and end, other processes' CPU seconds as cores' worth and as a share of wall x cores);
a section during which other processes used more than 0.10 cores keeps its figures but its ratios get the
verdict "contended: not a ratio", and the run's end names it; a llama.cpp batched reference slower for four
sequences than for one alone in the same context is a "broken reference: not a ratio"; where section 2's whole
model in one context is slower than its three shards in one process, the route is measured against the shards'
time (a slow reference); every timed figure's
rounds, min, median and max are in the JSON's "spread" (quick: 3 rounds each but section 10's one; verdicts on medians).
"""

# The package's docstring is `kvpool bench --help`'s description (here and in kvpool/cli/bench.py).
# Modules, in import order: options (BenchOptions, shared constants), checks (load, contention, broken
# and slow references, rounds), reference (llama.cpp contexts),
# rig (daemons, models, timing helpers), one_session (sections 1, 2, 4), parallel (section 3),
# admission (sections 5, 6), table (rows and cell formats), targets (sections 1-6's targets),
# one_session_report, parallel_report, admission_report (those sections' summaries and rows), warm
# (section 7: measurement, summary, chart panels), overload (section 8), startup (section 9), durable (section 10),
# move (section 11), prefix and prefix_report (section 12), report (`summarize`: every section in order), chart
# (the PNG), cli (run_bench, run_only, the command line).
