"""One session through kvpool.router.router: its appends walk a route of shard daemons, and what a failure
means is decided here, in one place:

- cache_miss (any daemon), worker_lost: replay. Release the session's epoch on every
  daemon, take epoch + 1, and send the session's token ids again from position 0, then the append.
- position_mismatch naming a length shorter than the append's start (a daemon adopted the session's state
  as written behind at that length, after a crash), or a lost connection: tail replay. Truncate every
  daemon to the shortest length one holds, send the tokens from there on (the same partition), then the
  append; the same epoch. A daemon that holds nothing answers that truncate cache_miss: a full replay.
  stale_epoch below a daemon's epoch floor (it forgot the id, kvpool.daemon.books.sessions): the same, at the floor.
- over_budget: back off (the reply's `retry_after_s` when it has one, else exponential with jitter,
  bounded) and ask the same daemon again, until `over_budget_give_up_s`.
- cancelled at daemon i (a daemon's reply, or `cancel()` seen between daemons): daemons 0..i-1 are
  truncated back to the length before the append, and `Cancelled` is raised.
- bad_request for an append whose block digests were chained with a block the route no longer keeps (its
  daemon replaced on the socket by one of another --prefix-block between the digests and the request: the
  client took the new daemon's Hello as it reconnected): that daemon is asked once more at once, with the
  digests of the route's block now; a refused append took nothing.
- anything else a daemon answers (stale_epoch, context_full, ...) is raised as a StageFailed after the
  same roll-back; a timeout or an interrupt leaves the session to be replayed by its next append.

A replay is exact: it repeats the session's appends with the same partition (kvpool.router.history), so
what follows a recovery is bit for bit what an uninterrupted run gives; `exact_replay=False` sends one
prefill instead. The knobs are a RecoveryPolicy, and what recovery did is counted in RecoveryCounts.

A re-plan (Router.replan) moves the session onto another route between two appends (move_to): its state is
exported, re-sliced and imported under epoch + 1 (kvpool.router.move); a session whose move fails, or whose
daemons may not hold its tokens, replays on the new route at its next append instead.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from kvpool.client.client import AppendResult, ConnectionLost, KvpoolError
from kvpool.local.generate import greedy_tokens
from kvpool.router.history import AppendHistory
from kvpool.router.in_flight import InFlightAppend
from kvpool.router.move import Moved, MoveFailed, move_session
from kvpool.router.prefix import PrefixChain, RestoringAhead, admit_everywhere, held_everywhere, route_block
from kvpool.router.recovery import Cancelled, RecoveryCounts, RecoveryFailed, RecoveryPolicy, epoch_floor_of, replay_counter
from kvpool.router.route import Route, StageFailed
from kvpool.wire.protocol import ErrorCode
from kvpool.wire.sampling import Sampling

# What a prompt's reuse of a prefix leaves to compute, at least: two rows keep the rest a prefill, since on a CPU
# build a one-row append and the same row inside a longer prefill do not give the same bits (kvpool.router.history)
MIN_COMPUTED_ROWS = 2
Count = Callable[[str, int], None]  # adds to a count of the router that made the session (all its sessions)


class RoutedSession:
    """One session through the router. Between calls, either every daemon holds the session's `tokens`
    under `epoch`, or the next append replays them first. One thread appends; cancel() may come from any,
    and move_to() (a re-plan) from any: it waits for the append in flight."""

    def __init__(
        self, route: Route, policy: RecoveryPolicy, session_id: str, *, epoch: int, n_ctx: int, admit_timeout_s: float,
        rng: random.Random, count: Count, prefix_cache: bool = True, prefix_scope: str = "",
    ) -> None:
        self.route = route
        self.policy = policy
        self.session_id = session_id
        self.epoch = epoch
        self.n_ctx = n_ctx
        self.admit_timeout_s = admit_timeout_s
        self.counts = RecoveryCounts()
        self._history = AppendHistory()
        self._needs_replay = False
        self._tail_from: int | None = None  # a daemon holds only this many tokens: the next append replays the rest first
        self._epoch_floor = 0  # the highest epoch floor a daemon named (a stale_epoch for an id it forgot)
        self._rng = rng
        self._count_in_router = count
        self._in_flight = InFlightAppend()
        self._lock = threading.Lock()  # one of: an append, a truncate, a release, a move
        self.prefix_cache = prefix_cache
        self.prefix_scope = prefix_scope
        self._chain = PrefixChain(prefix_scope)
        self._fresh = True  # no daemon holds anything of this session's epoch: a first append may start from a prefix
        self._restoring: RestoringAhead | None = None  # the later daemons' restores of a prefix just admitted

    @property
    def tokens(self) -> tuple[int, ...]:
        return self._history.tokens

    @property
    def length(self) -> int:
        return self._history.length

    @property
    def partition(self) -> tuple[int, ...]:
        """The row count of each append that built `tokens`, in order: what a replay repeats."""
        return self._history.partition

    @property
    def needs_replay(self) -> bool:
        """The daemons may not hold `tokens` (a failed truncate or roll-back): the next append replays first."""
        return self._needs_replay

    @property
    def settled(self) -> bool:
        """Every daemon holds `tokens` as far as the router knows. False while a replay or a tail replay is due
        (a connection lost inside a truncate or an append, a failed roll-back): until the next append runs it,
        a daemon may hold more of the session's tokens than `length` (a truncate that did not reach it), or fewer."""
        return not self._needs_replay and self._tail_from is None

    # ---- appends ---------------------------------------------------------------------------------

    def append(self, tokens: Sequence[int], *, output_rows: str = "last") -> np.ndarray:
        """Append token ids after the session's tokens; the last daemon's rows (logits) come back."""
        tokens = [int(token) for token in tokens]
        if not tokens:
            raise ValueError("an append needs at least one token")
        return self._guarded_append(tokens, output_rows, None).rows

    def sample(self, tokens: Sequence[int], sampling: Sampling) -> AppendResult:
        """Append token ids; the last daemon picks the next token (`.token`; `.top_ids`/`.top_logprobs`
        with sampling.logprobs; logits in `.rows` only with sampling.logits). The picked token is not
        appended: pass it to the next call."""
        tokens = [int(token) for token in tokens]
        if not tokens:
            raise ValueError("an append needs at least one token")
        return self._guarded_append(tokens, "last", sampling)

    def generate(
        self, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling | None = None, *, is_end: Callable[[int], bool] = lambda token: False
    ) -> Iterator[int]:
        """Append the prompt, then yield up to max_new_tokens tokens picked on the last shard (greedy by
        default): a few bytes per token cross the route's last hop instead of n_vocab floats."""
        sampling = sampling or Sampling()
        pending = [int(token) for token in prompt]
        for _ in range(max_new_tokens):
            token = self.sample(pending, sampling).token
            assert token is not None
            yield token
            if is_end(token):
                return
            pending = [token]

    def _guarded_append(self, tokens: list[int], output_rows: str, sampling: Sampling | None) -> AppendResult:
        with self._lock, self._in_flight.running():
            try:
                return self._append(tokens, output_rows, sampling)
            finally:
                if self._restoring is not None:  # a decode step pays one attribute read for it
                    self._restored()

    def append_at(self, start_pos: int, tokens: Sequence[int]) -> np.ndarray:
        """append() for callers that name the position (kvpool.local.generate); it must be the session's length."""
        if start_pos != self.length:
            raise ValueError(f"start_pos {start_pos} != the session's length {self.length}")
        return self.append(tokens)

    def greedy(
        self, prompt: Sequence[int], max_new_tokens: int, *, is_end: Callable[[int], bool] = lambda token: False, prefill_chunk: int = 0
    ) -> Iterator[int]:
        """Append the prompt after the session's tokens, then yield greedy tokens (see kvpool.local.generate)."""
        offset = self.length

        def append(start: int, tokens: Sequence[int]) -> np.ndarray:
            return self.append_at(offset + start, tokens)

        return greedy_tokens(append, prompt, max_new_tokens, is_end=is_end, prefill_chunk=prefill_chunk)

    def _append(self, tokens: list[int], output_rows: str, sampling: Sampling | None) -> AppendResult:
        start = self.length
        failures = 0
        while True:
            try:
                if self._needs_replay:
                    self._replay()
                elif self._tail_from is not None:
                    self._replay_tail()
                reused = self._reuse_prefix(tokens) if start == 0 and self._fresh and output_rows == "last" else 0
                self._fresh = False
                try:
                    result = self._walk(start + reused, tokens[reused:], output_rows, sampling, before=tokens[:reused] if reused else None)
                except BaseException:
                    if reused:
                        self._needs_replay = True  # the daemons hold the prefix, the router's history does not
                    raise
                if reused:
                    self._history.record(tokens[:reused])
                    tokens = tokens[reused:]
            except (StageFailed, ConnectionLost) as failure:
                tail = self._tail_for(failure, start)
                if tail is not None:
                    self._tail_from = min(tail, self._tail_from if self._tail_from is not None else tail)
                    failures = self._one_more_failure(failures, failure)
                    continue
                counter = replay_counter(failure)
                if counter is None:
                    if self._tail_from is not None:
                        self._needs_replay = True  # the daemons hold different lengths: the next append starts over
                    self._roll_back(start, failure.stage)
                    raise
                self._count(counter)
                self._epoch_floor = max(self._epoch_floor, epoch_floor_of(failure))
                self._needs_replay = True
                failures = self._one_more_failure(failures, failure)
                continue
            except Cancelled as cancelled:
                if self._tail_from is not None:
                    self._needs_replay = True  # cancelled inside a tail replay: the daemons hold different lengths
                self._roll_back(start, cancelled.stage)
                raise
            except BaseException:
                self._needs_replay = True  # a timeout, an interrupt: what the daemons hold is unknown
                raise
            self._history.record(tokens)
            return result

    def _walk(
        self, start: int, tokens: list[int], output_rows: str, sampling: Sampling | None = None, *, before: list[int] | None = None,
    ) -> AppendResult:
        """One append through every daemon; `before`: the tokens at [0, start) when the history does not hold them yet."""
        rows: list[int] | np.ndarray = tokens
        result: AppendResult | None = None
        block = self._block()
        digests = self._completed_digests(start, tokens, before, block)
        for stage in range(len(self.route)):
            if stage and self._restoring is not None:
                self._restored()
            self._in_flight.reach(stage)
            try:
                result = self._append_at_stage(stage, start, rows, output_rows, sampling, digests)
            except StageFailed as failure:
                if not (digests and failure.code == ErrorCode.BAD_REQUEST and self._block() != block):
                    raise
                block = self._block()  # the daemon was replaced by one of another block (the module's docstring)
                digests = self._completed_digests(start, tokens, before, block)
                result = self._append_at_stage(stage, start, rows, output_rows, sampling, digests)
            rows = result.rows
        assert result is not None
        return result

    def _completed_digests(self, start: int, tokens: list[int], before: list[int] | None, block: int) -> list[bytes]:
        """The digests of the blocks an append of `tokens` at `start` completes, chained with `block` (none: 0)."""
        if not block or (start + len(tokens)) // block == start // block:
            return []
        return self._chain.completed(self._history.token_slice(0, start) if before is None else before, tokens, block)

    def _append_at_stage(
        self, stage: int, start: int, rows: list[int] | np.ndarray, output_rows: str, sampling: Sampling | None, digests: list[bytes],
    ) -> AppendResult:
        """One daemon's part; over_budget is answered here by backing off and asking that daemon again."""
        give_up_at = time.monotonic() + self.policy.over_budget_give_up_s
        attempt = 0
        while True:
            try:
                return self.route.append_at(
                    stage, self.session_id, self.epoch, start, rows, output_rows=output_rows, n_ctx=self.n_ctx,
                    admit_timeout_s=self.admit_timeout_s, sample=sampling, block_digests=digests, prefix_scope=self.prefix_scope,
                )
            except StageFailed as failure:
                if failure.code == ErrorCode.CANCELLED:
                    raise Cancelled(stage) from None
                left = give_up_at - time.monotonic()
                if failure.code != ErrorCode.OVER_BUDGET or left <= 0:
                    raise
                self._count("over_budget_retries")
                self._in_flight.pause(min(left, self.policy.delay_s(attempt, self._rng, getattr(failure.reply, "retry_after_s", None))))
                attempt += 1

    def _one_more_failure(self, failures: int, failure: Exception) -> int:
        """Count a failure that recovery answers: past max_replays in a row RecoveryFailed, else back off
        before every try after the first."""
        failures += 1
        if failures > self.policy.max_replays:
            raise RecoveryFailed(f"{self.session_id}: {failures} failures in a row, the last: {failure}") from failure
        if failures > 1:
            self._in_flight.pause(self.policy.delay_s(failures - 2, self._rng))
        return failures

    def _tail_for(self, failure: StageFailed | ConnectionLost, start: int) -> int | None:
        """The length a tail replay starts from for this failure, None when it needs no tail replay: a daemon
        holding fewer of the session's tokens than the router sent it (position_mismatch), or a lost
        connection while no full replay is due (the daemon, or the one restarted on its socket, may hold
        the session at some length: truncating every daemon to `start` finds out; one that holds nothing
        answers cache_miss, and the replay is full)."""
        if isinstance(failure, ConnectionLost):
            if self._needs_replay:
                return None
            self._count("connections_lost")
            return start
        if failure.code == ErrorCode.POSITION_MISMATCH and 0 <= failure.length < start:
            return failure.length
        return None

    def _replay_tail(self) -> None:
        """Truncate every daemon to the shortest length one holds, then repeat the appends from there. A
        length inside an append (not where a state could have been written) starts a full replay instead.
        A daemon that answers otherwise (cache_miss: it lost the session) raises, and _append replays in full."""
        self._restored()
        length = self._tail_from
        assert length is not None
        while True:
            try:
                self.route.truncate(self.session_id, self.epoch, length)
                break
            except StageFailed as failure:
                if not (failure.code == ErrorCode.POSITION_MISMATCH and 0 <= failure.length < length):
                    raise
                length = failure.length
        if length < self._history.length:
            self._count("position_mismatches")  # a daemon held fewer of the session's tokens
        partition = self._history.replay_partition_from(length, self.policy.exact_replay)
        if partition is None:
            self._tail_from = None
            self._replay()
            return
        position = length
        for rows in partition:
            self._walk(position, self._history.token_slice(position, rows), "last")
            position += rows
        self._tail_from = None
        if position > length:
            self._count("tail_replays")
            self._count("tail_replayed_tokens", position - length)

    def _replay(self) -> None:
        """Release the epoch everywhere, take the next one, and repeat the session's appends from 0."""
        self._restored()  # no restore of the old epoch still on its way while it is released
        with contextlib.suppress(KvpoolError, ConnectionLost):
            self.route.release(self.session_id, self.epoch)  # frees room first; a dead daemon is found below
        self.epoch = max(self.epoch + 1, self._epoch_floor)
        position = reused = self._reuse_for_replay()
        self._fresh = position == 0  # the new epoch holds nothing yet unless a prefix was admitted
        partition = self._history.replay_partition_from(position, self.policy.exact_replay)
        assert partition is not None
        for rows in partition:
            self._fresh = False
            self._walk(position, self._history.token_slice(position, rows), "last")
            position += rows
        self._needs_replay = False
        self._tail_from = None
        if position:
            self._count("replays")
            self._count("replayed_tokens", position - reused)

    # ---- shared prefixes (kvpool.router.prefix) ----------------------------------------------------

    def _block(self) -> int:
        return route_block(self.route) if self.prefix_cache else 0

    def _restored(self) -> None:
        """The restores ahead of a prefix just admitted are answered (whatever they answered: a daemon where it
        failed restores the session with its part of the append, or answers as the contract says). Called before
        the second daemon's part of a walk, as an append returns or raises, and before anything else the session
        sends (a replay, a truncate, a release, a move): none of those meets a restore still on its way; one an
        interrupt left running is waited for there."""
        if self._restoring is not None:
            self._restoring.wait()
            self._restoring = None

    def _reuse_prefix(self, tokens: list[int]) -> int:
        """A new session's first append (or its retry): the longest prefix of whole blocks every daemon holds,
        leaving at least MIN_COMPUTED_ROWS tokens to compute, admitted on every daemon; the positions taken (0: none)."""
        block = self._block()
        if not block or len(tokens) < block + MIN_COMPUTED_ROWS:
            return 0
        digests = self._chain.digests(tokens, block)[: (len(tokens) - MIN_COMPUTED_ROWS) // block]
        return self._admit_prefix(digests, block)

    def _reuse_for_replay(self) -> int:
        """A replay from 0: a prefix every daemon holds, up to where one of the session's appends ended when
        replays repeat the partition (exact_replay: the appends after it are computed as they were); the
        positions taken (0: none)."""
        block = self._block()
        if not block or self._history.length < block:
            return 0
        digests = self._chain.digests(self._history.tokens, block)
        held = held_everywhere(self.route, self.prefix_scope, digests)
        boundaries = {0}
        if self.policy.exact_replay:
            ends = np.cumsum(self._history.partition)
            boundaries |= {int(end) for end in ends if end % block == 0 and end <= held * block}
        else:
            boundaries.add(held * block)
        blocks = max(boundaries) // block
        return self._admit_prefix(digests[:blocks], block, held=blocks)

    def _admit_prefix(self, digests: list[bytes], block: int, *, held: int | None = None) -> int:
        self._restored()  # an earlier admission's restores (its append failed or was interrupted): answered first
        if held is None:
            held = held_everywhere(self.route, self.prefix_scope, digests)
        if not held:
            return 0
        if not admit_everywhere(self.route, self.session_id, self.epoch, self.prefix_scope, digests[:held], self.n_ctx):
            self._count("prefix_fallbacks")
            return 0
        self._restoring = RestoringAhead.start(self.route, self.session_id, self.epoch)  # the first daemon's is its first append's
        self._count("prefix_hits")
        self._count("prefix_hit_tokens", held * block)
        return held * block

    def _roll_back(self, start: int, stage: int) -> None:
        """The append failed at `stage`: daemons before it took its rows; take them back to `start`."""
        if self._needs_replay or stage == 0:
            return
        try:
            self.route.truncate(self.session_id, self.epoch, start, stages=range(stage))
            self._count("rollbacks")
        except (KvpoolError, ConnectionLost):
            self._needs_replay = True

    # ---- the rest of a session's life ---------------------------------------------------------------

    def cancel(self) -> bool:
        """Cancel the append in flight (from another thread): the daemon computing it is told at once, and
        the walk stops before the next daemon. Returns False when no append was in flight."""
        cancelled = self._in_flight.cancel(lambda: self.epoch)
        if cancelled is None:
            return False
        stage, epoch = cancelled
        if stage >= 0:
            with contextlib.suppress(KvpoolError, ConnectionLost):
                self.route.clients[stage].cancel(self.session_id, epoch)
        return True

    def truncate(self, length: int) -> None:
        """Keep positions [0, length). A daemon that lost the session is caught up by the next append."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate to {length}: the session holds {self.length} tokens")
        with self._lock:
            self._restored()
            self._truncate(length)

    def _truncate(self, length: int) -> None:
        if not self._needs_replay:
            try:
                self.route.truncate(self.session_id, self.epoch, length)
            except (StageFailed, ConnectionLost) as failure:
                tail = self._tail_for(failure, length)  # the daemons hold `length` or less: the next append replays the tail
                if tail is not None:
                    self._tail_from = min(tail, self._tail_from if self._tail_from is not None else tail)
                else:
                    self._needs_replay = True
                    if replay_counter(failure) is None:
                        raise
        self._history.truncate(length)

    def release(self) -> None:
        """Release the session on every daemon; it may start again from an empty append history."""
        with self._lock:
            self._restored()
            self._release()

    def _release(self) -> None:
        self._history.clear()
        self._needs_replay = False
        self._tail_from = None
        try:
            self.route.release(self.session_id, self.epoch)
            self._fresh = True
        except BaseException:
            self._needs_replay = True  # the next append releases again, under the next epoch
            raise

    def move_to(self, route: Route) -> Moved | MoveFailed | None:
        """Switch the session onto `route` (a re-plan): its state moved under the next epoch (Moved), or, when
        the move fails (MoveFailed) or the daemons may not hold its tokens (None), released on the old route
        and replayed on the new one by its next append. Waits for an append in flight."""
        with self._lock:
            self._restored()
            old, self.route = self.route, route
            if not self._history.length or self._needs_replay or self._tail_from is not None:
                with contextlib.suppress(KvpoolError, ConnectionLost):
                    old.release(self.session_id, self.epoch)
                self._needs_replay = bool(self._history.length)
                self._tail_from = None
                self._fresh = True
                return None
            new_epoch = max(self.epoch + 1, self._epoch_floor)
            try:
                moved = move_session(old, route, self.session_id, self.epoch, new_epoch, self._history.length)
            except MoveFailed as failure:  # move_session released the old epoch
                self.epoch = new_epoch  # the replay releases what the new route may hold of it, then takes the next
                self._needs_replay = True
                self._count("move_failures")
                return failure
            self.epoch = new_epoch
            self._fresh = False
            self._count("moves")
            self._count("moved_bytes", moved.imported_bytes)
            return moved

    def _count(self, field: str, amount: int = 1) -> None:
        setattr(self.counts, field, getattr(self.counts, field) + amount)
        self._count_in_router(field, amount)
