"""`kvpool stress`: concurrent sessions through a chain of shard daemons, fault drills, and the exactness check.

N sessions (one thread each, one Client per daemon each) run a seeded random mix of operations through a
route of `kvpool serve` daemons: chunked prefill, greedy decode, truncate then replay, cancel (landing in
the middle of a long prefill on each daemon of the route, and sent after an append completed), release
and re-open, an epoch bump, and a stale-epoch request. Each session keeps a log of the operations that
took effect; afterwards every log is replayed alone on a fresh chain of daemons (or in process) and every
returned row, every greedy token and the final logits must be bit-identical. Any difference is cross-talk
and fails the run.

Scenarios add faults, each bounded by operations: a byte budget for fewer sessions than are active (LRU
eviction), a short TTL (expiry), a SIGKILLed worker, a SIGKILLed supervisor (restarted on its socket), a
SIGSTOPped worker (the daemon's request timeout), and a connection that never reads its replies
(backpressure). Two drills check the durability contract on daemons with a disk tier: a rolling restart
(--restart: each daemon drained by SIGTERM in turn and a successor started on its socket and spill dir; no
session replays from 0, appends are answered restored: true) and a crash with --persist-after (a SIGKILLed
supervisor; the restarted daemon adopts the copies written behind and the router replays only the tail). Shared
prefixes (--shared-prefix, kvpool.stress.prefixes): prompts beginning with a few system prompts, through daemons
with a prefix store; fresh sessions start from the longest prefix every daemon stores, each exact, the hits counted
(a run with none fails). After every run each daemon must hold no session of ours, have its reserved bytes back
where they were, balanced books, its workers' measured memory back within a stated tolerance, and no
process or shared-memory segment of the daemons may outlive them.

A run fails only when something ran and behaved wrongly; what timing did not let it exercise is listed
as a warning. The operations of each session are seeded; how the sessions' requests interleave is up to
the scheduler, so two runs with one seed issue the same operations per session but not in the same
global order.
"""
