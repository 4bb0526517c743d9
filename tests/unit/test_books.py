"""Pure-Python tests of the books: the byte budget and the session table (fake sizes, a driven clock)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.daemon.books.books import Books, Spare, SpareOwner
from kvpool.daemon.books.budget import ByteBudget, OverBudget
from kvpool.daemon.books.integrity import IntegrityError
from kvpool.daemon.books.sessions import EpochCheck, Session, SessionTable
from kvpool.daemon.books.spill import SpillStore
from kvpool.wire.protocol import MissReason
from tests.support.fake_worker import FakeSequence

# ---- ByteBudget -----------------------------------------------------------------------------------


def test_reserve_charges_owner_and_shrinks_available() -> None:
    budget = ByteBudget(1000)
    budget.reserve("a", 300)
    assert budget.fits(700) and not budget.fits(701)
    budget.reserve("b", 700)  # exactly what is left
    assert (budget.reserved, budget.available, budget.fits(1)) == (1000, 0, False)
    assert (budget.charge_of("a"), budget.charge_of("b"), budget.charge_of("nobody")) == (300, 700, 0)
    assert sorted(budget.owners()) == ["a", "b"]
    budget.check_integrity({"a", "b"})


def test_release_is_idempotent_and_returns_the_bytes() -> None:
    budget = ByteBudget(1000)
    budget.reserve("a", 250)
    assert budget.release("a") == 250
    assert budget.release("a") == 0
    assert budget.release("never") == 0
    assert (budget.reserved, budget.charge_of("a")) == (0, 0)
    budget.reserve("a", 1000)  # the owner may reserve again once released
    assert budget.reserved == 1000


def test_second_reservation_for_one_owner_is_rejected_and_leaves_the_first() -> None:
    budget = ByteBudget(1000)
    budget.reserve("a", 100)
    with pytest.raises(ValueError):
        budget.reserve("a", 50)
    assert (budget.charge_of("a"), budget.reserved) == (100, 100)


def test_over_budget_reports_sizes_and_leaves_the_books_unchanged() -> None:
    budget = ByteBudget(1000)
    budget.reserve("a", 900)
    with pytest.raises(OverBudget) as raised:
        budget.reserve("b", 101)
    assert (raised.value.requested, raised.value.available) == (101, 100)
    assert (budget.reserved, budget.charge_of("b"), budget.owners()) == (900, 0, ["a"])
    budget.check_integrity({"a"})


@pytest.mark.parametrize("nbytes", [0, -1])
def test_non_positive_amounts_are_rejected(nbytes: int) -> None:
    with pytest.raises(ValueError):
        ByteBudget(nbytes)
    budget = ByteBudget(1000)
    with pytest.raises(ValueError):
        budget.reserve("a", nbytes)
    assert (budget.reserved, budget.owners()) == (0, [])


def test_reserving_releases_when_the_block_raises_and_keeps_on_success() -> None:
    budget = ByteBudget(1000)
    budget.reserve("other", 100)
    with pytest.raises(RuntimeError, match="admission failed"):
        with budget.reserving("a", 500):
            assert budget.charge_of("a") == 500
            raise RuntimeError("admission failed")
    assert (budget.reserved, budget.charge_of("a"), budget.owners()) == (100, 0, ["other"])
    with budget.reserving("a", 500):
        pass
    assert (budget.charge_of("a"), budget.reserved) == (500, 600)


def test_reserving_that_cannot_reserve_does_not_release_the_existing_charge() -> None:
    budget = ByteBudget(1000)
    budget.reserve("a", 100)
    with pytest.raises(ValueError):
        with budget.reserving("a", 200):
            pytest.fail("the block must not run")
    with pytest.raises(OverBudget):
        with budget.reserving("b", 901):
            pytest.fail("the block must not run")
    assert (budget.charge_of("a"), budget.reserved) == (100, 100)


def test_check_integrity_compares_the_live_set() -> None:
    budget = ByteBudget(1000)
    budget.reserve("a", 10)
    budget.reserve("b", 20)
    budget.check_integrity(["b", "a"])
    budget.check_integrity()
    with pytest.raises(IntegrityError):
        budget.check_integrity({"a"})  # a charge without a live owner: leaked bytes
    with pytest.raises(IntegrityError):
        budget.check_integrity({"a", "b", "c"})  # a live owner without a charge


class BudgetMachine(RuleBasedStateMachine):
    """Random reserve/release against a plain dict model of the charges."""

    LIMIT = 1000
    owners = st.sampled_from("abcdefgh")

    def __init__(self) -> None:
        super().__init__()
        self.budget = ByteBudget(self.LIMIT)
        self.model: dict[str, int] = {}

    @rule(owner=owners, nbytes=st.integers(min_value=-5, max_value=600))
    def reserve(self, owner: str, nbytes: int) -> None:
        free = self.LIMIT - sum(self.model.values())
        if nbytes <= 0 or owner in self.model:
            with pytest.raises(ValueError):
                self.budget.reserve(owner, nbytes)
        elif nbytes > free:
            with pytest.raises(OverBudget):
                self.budget.reserve(owner, nbytes)
        else:
            self.budget.reserve(owner, nbytes)
            self.model[owner] = nbytes

    @rule(owner=owners)
    def release(self, owner: str) -> None:
        assert self.budget.release(owner) == self.model.pop(owner, 0)

    @invariant()
    def books_match_the_model(self) -> None:
        assert self.budget.reserved == sum(self.model.values()) <= self.LIMIT
        assert all(self.budget.charge_of(owner) == nbytes for owner, nbytes in self.model.items())
        self.budget.check_integrity(self.model.keys())


BudgetMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestBudgetMachine = BudgetMachine.TestCase

# ---- SessionTable ---------------------------------------------------------------------------------


def make_session(session_id: str, epoch: int = 0, *, last_used: float = 0.0, in_flight: int = 0) -> Session:
    return Session(session_id, epoch, n_ctx=128, charged_bytes=1024, worker_name=f"w-{session_id}", last_used=last_used, in_flight=in_flight)


def test_session_has_its_own_lock_usable_in_a_later_loop() -> None:
    first, second = make_session("a"), make_session("b")  # built outside any running loop
    assert first.lock is not second.lock and first.key == ("a", 0) and first.idle

    async def hold_both() -> bool:
        async with first.lock:
            return first.lock.locked() and not second.lock.locked()

    assert asyncio.run(hold_both())


def test_check_epoch_fences_lower_and_flags_higher() -> None:
    table = SessionTable()
    assert table.check_epoch("a", 7) is EpochCheck.CURRENT  # first sight
    assert table.highest_epoch("a") is None  # checking records nothing
    table.see_epoch("a", 3)
    assert table.check_epoch("a", 3) is EpochCheck.CURRENT
    assert table.check_epoch("a", 2) is EpochCheck.STALE
    assert table.check_epoch("a", 4) is EpochCheck.NEWER
    assert table.check_epoch("b", 0) is EpochCheck.CURRENT  # ids are fenced independently
    table.see_epoch("a", 1)  # see_epoch never lowers the remembered epoch
    assert (table.highest_epoch("a"), table.check_epoch("a", 2)) == (3, EpochCheck.STALE)
    table.see_epoch("a", 6)
    assert table.highest_epoch("a") == 6


def test_add_get_remove() -> None:
    table = SessionTable()
    a, b = make_session("a", 2), make_session("b")
    table.add(a)
    table.add(b)
    assert (len(table), table.get("a"), table.get("zzz")) == (2, a, None)
    assert table.highest_epoch("a") == 2  # adding sees the epoch
    with pytest.raises(IntegrityError):
        table.add(make_session("a", 3))  # one live epoch per session id
    table.remove(a, MissReason.EVICTED)
    assert (len(table), table.get("a"), table.sessions()) == (1, None, [b])
    table.add(new := make_session("a", 3))
    table.remove(a, MissReason.WORKER_LOST)  # a late removal of the replaced object keeps the live one
    assert (table.get("a"), table.miss_reason("a", 2)) == (new, MissReason.WORKER_LOST)


def test_miss_reasons() -> None:
    table = SessionTable()
    assert table.miss_reason("never", 0) is MissReason.UNKNOWN
    a = make_session("a", 1)
    table.add(a)
    table.remove(a, MissReason.EXPIRED)
    assert table.miss_reason("a", 1) is MissReason.EXPIRED
    assert table.miss_reason("a", 2) is MissReason.UNKNOWN  # reasons are per (id, epoch)
    table.note_new_epoch("a", 2)
    assert table.miss_reason("a", 2) is MissReason.NEW_EPOCH
    assert table.miss_reason("a", 1) is MissReason.EXPIRED


def test_re_adding_a_session_clears_its_tombstone() -> None:
    table = SessionTable()
    table.add(first := make_session("a", 1))
    table.remove(first, MissReason.RELEASED)
    table.add(make_session("a", 1))
    assert table.miss_reason("a", 1) is MissReason.UNKNOWN
    table.note_new_epoch("b", 4)
    table.add(make_session("b", 4))
    assert table.miss_reason("b", 4) is MissReason.UNKNOWN


def test_lru_idle_orders_by_last_use_and_skips_busy_sessions() -> None:
    table = SessionTable()
    for session in (make_session("a", last_used=30.0), make_session("b", last_used=10.0, in_flight=1),
                    make_session("c", last_used=5.0), make_session("d", last_used=20.0)):
        table.add(session)
    assert [s.session_id for s in table.least_recently_used_idle()] == ["c", "d", "a"]
    table.get("b").in_flight = 0
    table.get("c").in_flight = 2
    assert [s.session_id for s in table.least_recently_used_idle()] == ["b", "d", "a"]


def test_expired_returns_only_idle_sessions_idle_for_at_least_ttl() -> None:
    table = SessionTable()
    for session in (make_session("old", last_used=0.0), make_session("edge", last_used=40.0),
                    make_session("fresh", last_used=41.0), make_session("busy", last_used=0.0, in_flight=1)):
        table.add(session)
    assert sorted(s.session_id for s in table.expired(now=100.0, ttl_s=60.0)) == ["edge", "old"]
    assert table.expired(now=30.0, ttl_s=60.0) == []


# Regression (issue 17, item 2): the highest-epoch memory forgot the least recently touched id, and a request at
# an epoch below the one it had reached was then admitted as first sight. Forgetting now raises the floor instead.
def test_forgetting_an_id_raises_the_floor_so_its_old_epochs_stay_stale() -> None:
    table = SessionTable(remembered_ids=3)
    table.see_epoch("x", 5)
    for session_id in "abc":
        table.see_epoch(session_id, 1)  # x, at the highest epoch, is kept: the lowest epoch is forgotten first
    assert (table.highest_epoch("x"), table.highest_epoch("a"), table.epoch_floor) == (5, None, 1)
    assert table.check_epoch("a", 0) is EpochCheck.STALE  # a forgotten id stays fenced below the floor
    assert table.check_epoch("a", 1) is EpochCheck.CURRENT  # ... and is a new session at the floor
    for session_id in "def":
        table.see_epoch(session_id, 7)
    assert table.highest_epoch("x") is None and table.epoch_floor == 5  # x forgotten: the floor holds its epoch
    assert table.check_epoch("x", 3) is EpochCheck.STALE
    assert table.check_epoch("x", 5) is EpochCheck.CURRENT
    assert table.check_epoch("new", 4) is EpochCheck.STALE  # named in the reply: start new sessions at >= 5
    assert len(table._epochs) <= 3


def test_an_id_stepping_through_epochs_keeps_the_memory_bounded() -> None:
    """A client that releases one id at ever higher epochs (cheap: no worker) must not grow the daemon's memory."""
    table = SessionTable(remembered_ids=8)
    for epoch in range(1, 20001):
        table.see_epoch("x", epoch)
    assert table.highest_epoch("x") == 20000 and table.check_epoch("x", 19999) is EpochCheck.STALE
    assert len(table._epochs) == 1 and len(table._epochs._epochs) <= 2 * 1 + 64


def test_ids_at_or_below_the_floor_take_no_room() -> None:
    table = SessionTable(remembered_ids=2)
    for session_id in "abc":
        table.see_epoch(session_id, 2)
    assert table.epoch_floor == 2
    table.see_epoch("d", 2)  # what the floor says already: not filed, nothing else forgotten
    assert [table.highest_epoch(i) for i in "bcd"] == [2, 2, None] and table.epoch_floor == 2


def test_the_tombstones_forget_the_least_recently_touched() -> None:
    table = SessionTable(remembered_ids=3)
    for session_id in "abcd":
        table.add(session := make_session(session_id))
        table.remove(session, MissReason.EVICTED)
    assert [table.miss_reason(i, 0) for i in "abcd"] == [MissReason.UNKNOWN] + [MissReason.EVICTED] * 3


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdefgh"), st.integers(min_value=0, max_value=6)), max_size=80),
       st.integers(min_value=1, max_value=4))
def test_bounded_fence_never_lets_a_stale_epoch_through(sequence: list[tuple[str, int]], bound: int) -> None:
    """Whatever the traffic, an epoch below the highest seen for its id is refused; memory stays bounded."""
    table = SessionTable(remembered_ids=bound)
    highest: dict[str, int] = {}
    for session_id, epoch in sequence:
        check = table.check_epoch(session_id, epoch)
        if session_id in highest and epoch < highest[session_id]:
            assert check is EpochCheck.STALE
        if check is not EpochCheck.STALE:
            table.see_epoch(session_id, epoch)
            highest[session_id] = max(epoch, highest.get(session_id, epoch))
        assert len(table._epochs) <= bound
        assert table.epoch_floor <= max(highest.values(), default=0)


# Regression: note_new_epoch once wrote into the bounded tombstone memory without trimming it.
def test_note_new_epoch_respects_the_tombstone_bound() -> None:
    table = SessionTable(remembered_ids=3)
    for session_id in "abcd":
        table.note_new_epoch(session_id, 1)
    assert table.miss_reason("a", 1) is MissReason.UNKNOWN


# Regression: the bounded highest-epoch memory could forget a still-live session's epoch, and a lower epoch then
# checked CURRENT instead of STALE. A live session's own epoch now always counts.
def test_live_session_stays_fenced_after_many_other_ids() -> None:
    table = SessionTable(remembered_ids=3)
    table.add(make_session("live", 5))
    for session_id in "xyz":
        table.see_epoch(session_id, 0)
    assert table.check_epoch("live", 2) is EpochCheck.STALE


requests = st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(min_value=0, max_value=5)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(requests)
def test_fencing_rule_remembers_the_highest_epoch_per_id(sequence: list[tuple[str, int]]) -> None:
    """The contract's fence: stale touches nothing; newer releases the old epoch's state first."""
    table = SessionTable()
    highest: dict[str, int] = {}
    for session_id, epoch in sequence:
        check = table.check_epoch(session_id, epoch)
        assert (check is EpochCheck.STALE) == (session_id in highest and epoch < highest[session_id])
        assert (check is EpochCheck.NEWER) == (session_id in highest and epoch > highest[session_id])
        live_before = table.get(session_id)
        if check is not EpochCheck.STALE:  # a stale request touches nothing
            table.see_epoch(session_id, epoch)
            if check is EpochCheck.NEWER:
                table.note_new_epoch(session_id, epoch)
                if live_before is not None:
                    table.remove(live_before, MissReason.NEW_EPOCH)
                    assert table.miss_reason(session_id, live_before.epoch) is MissReason.NEW_EPOCH
            if table.get(session_id) is None:
                table.add(make_session(session_id, epoch))
            highest[session_id] = max(epoch, highest.get(session_id, epoch))
        assert all(table.highest_epoch(i) == e for i, e in highest.items())
        assert all(s.epoch == highest[s.session_id] for s in table.sessions())  # live state is never stale


def test_integrity_checks_hold_under_python_optimize() -> None:
    """`python -O` strips asserts: the books' checks must raise all the same."""
    program = (
        "from kvpool.daemon.books.budget import ByteBudget\n"
        "from kvpool.daemon.books.integrity import IntegrityError\n"
        "budget = ByteBudget(1000)\n"
        "budget.reserve('a', 10)\n"
        "try:\n"
        "    budget.check_integrity({'a', 'b'})\n"
        "except IntegrityError as error:\n"
        "    print('raised:', error)\n"
    )
    completed = subprocess.run([sys.executable, "-O", "-c", program], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.startswith("raised: charged")


# ---- Books: sessions, budget and worker binding as one set ----------------------------------------


class BooksMachine(RuleBasedStateMachine):
    """Admissions (with LRU eviction, sparing sessions used within a residency window), releases, parks
    (the context freed or kept as its worker's spare), in-flight requests, calibrations, dead and replaced
    workers, in any order, against a plain model: the books must balance after every step, every live
    session must own its worker alone, spares must stay on free workers and be taken for room first."""

    LIMIT = 1000
    ids = st.sampled_from("abcdef")

    def __init__(self) -> None:
        super().__init__()
        self.names = iter(f"w{index}" for index in range(10_000))
        self.books = Books(self.LIMIT, [next(self.names) for _ in range(3)], spill=SpillStore(1 << 20))
        self.dead: set[str] = set()
        self.clock = 0.0
        self.in_transit: set[str] = set()  # taken by the machine itself (calibrations, freed contexts)

    def usable(self, worker: str) -> bool:
        return worker not in self.dead

    @rule(session_id=ids, charge=st.integers(min_value=1, max_value=700), residency=st.sampled_from([0.0, 1.5, 4.5]), n_ctx=st.sampled_from([64, 128]))
    def admit(self, session_id: str, charge: int, residency: float, n_ctx: int) -> None:
        """`residency` in clock ticks: sessions used within it are never victims (kvpool.daemon.admission.residency)."""
        if self.books.table.get(session_id) is not None:
            return
        protected_after = self.clock - residency
        idle = self.books.table.least_recently_used_idle()
        evictable = {s.session_id: s for s in idle if s.last_used <= protected_after}
        matching = [w for w in self.books.free_workers() if self.usable(w) and (spare := self.books.spare_of(w)) and spare.n_ctx == n_ctx]
        plan = self.books.plan_admission(charge, self.usable, n_ctx=n_ctx, protected_after=protected_after)
        if plan is None:
            room = self.books.budget.available + self.books.spare_bytes + sum(s.charged_bytes for s in evictable.values())
            has_worker = bool(evictable) or any(map(self.usable, self.books.free_workers()))
            assert room < charge or not has_worker, "a feasible admission was refused"
            return
        assert [v.session_id for v in plan.victims] == list(evictable)[: len(plan.victims)], "victims not LRU first"
        assert all(v.last_used <= protected_after for v in plan.victims), "a protected session was evicted"
        assert plan.worker is None or self.usable(plan.worker)
        assert not matching or plan.worker in matching, "a spare of the session's n_ctx was passed over"
        if plan.victims and plan.worker is not None:  # evicted for bytes (not for a worker): every spare went first
            assert all(w == plan.worker or w in plan.spares for w in self.books.free_workers() if self.books.spare_of(w)), \
                "a session was evicted while a spare could have made room"
        self.clock += 1
        session, released = self.books.admit(plan, session_id=session_id, epoch=1, n_ctx=n_ctx, charge=charge, now=self.clock)
        assert self.books.session_of(session.worker_name) is session and session.worker_name not in self.dead
        assert all(self.books.table.miss_reason(v.session_id, 1) is MissReason.EVICTED for v in plan.victims)
        assert set(plan.spares) <= set(released) and all(self.books.spare_of(w) is None for w in released)
        self.in_transit.update(released)

    @rule(session_id=ids, keep=st.booleans())
    def park(self, session_id: str, keep: bool) -> None:
        session = self.books.table.get(session_id)
        if session is None or not session.hot or not session.idle:
            return
        worker, charge, n_ctx = session.worker_name, session.charged_bytes, session.n_ctx
        freed, _dropped = self.books.park(session, b"a saved state", kept=keep)
        if keep:
            assert freed is None and self.books.state_of(worker) == "free" and self.books.spare_of(worker) == Spare(n_ctx, charge)
        else:
            assert freed == worker and self.books.spare_of(worker) is None
            self.in_transit.add(worker)

    @rule(session_id=ids, keep=st.booleans())
    def release(self, session_id: str, keep: bool) -> None:
        session = self.books.table.get(session_id)
        if session is None or not session.idle:
            return
        hot, worker, charge, n_ctx = session.hot, session.worker_name, session.charged_bytes, session.n_ctx
        freed = self.books.forget(session, MissReason.RELEASED, kept=keep)
        if hot and keep:  # its worker kept the context (CloseContext.keep): free at once, the charge on the spare
            assert freed is None and self.books.state_of(worker) == "free" and self.books.spare_of(worker) == Spare(n_ctx, charge)
        elif freed is not None:
            self.in_transit.add(freed)

    @rule(session_id=ids, busy=st.booleans())
    def request_in_flight(self, session_id: str, busy: bool) -> None:
        session = self.books.table.get(session_id)
        if session is not None:
            session.in_flight = 1 if busy else 0
            self.clock += 1
            session.last_used = self.clock

    @rule()
    def finish_a_transit(self) -> None:
        if self.in_transit:
            worker = sorted(self.in_transit)[0]
            self.in_transit.discard(worker)
            if worker in self.dead:
                self.books.remove_worker(worker)
                self.books.add_worker(next(self.names))
            else:
                self.books.give_back(worker)

    @rule()
    def calibrate(self) -> None:
        worker = self.books.take(self.usable)
        if worker is not None:
            assert self.books.state_of(worker) == "in transit"
            self.in_transit.add(worker)

    @rule(data=st.data())
    def a_free_worker_dies(self, data) -> None:
        free = self.books.free_workers()
        if free:
            self.dead.add(data.draw(st.sampled_from(free)))

    @rule()
    def replace_dead_free(self) -> None:
        self.in_transit.update(self.books.take_unusable(self.usable))

    @invariant()
    def books_balance(self) -> None:
        self.books.check_integrity()
        live = self.books.table.sessions()
        hot = sum(s.charged_bytes for s in live if s.hot)
        assert self.books.session_bytes == hot and self.books.budget.reserved == hot + self.books.spare_bytes <= self.LIMIT
        assert all(self.books.state_of(w) == "free" for w in self.books.workers() if self.books.spare_of(w) is not None)
        assert len({s.worker_name for s in live if s.hot}) == len([s for s in live if s.hot])
        assert all(self.books.state_of(w) == "in transit" for w in self.in_transit)


BooksMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestBooksMachine = BooksMachine.TestCase


def test_books_integrity_catches_a_worker_in_two_states_and_a_leaked_charge() -> None:
    books = Books(1000, ["w1", "w2"])
    plan = books.plan_admission(100, lambda _w: True)
    assert plan is not None and plan.victims == ()
    session, released = books.admit(plan, session_id="s", epoch=1, n_ctx=64, charge=100, now=0.0)
    assert released == [] and books.state_of(session.worker_name) == "bound"
    books.check_integrity()
    books._free.append(session.worker_name)  # the same worker free and bound
    with pytest.raises(IntegrityError, match="two states"):
        books.check_integrity()
    books._free.remove(session.worker_name)
    books.budget.reserve("leak", 5)
    with pytest.raises(IntegrityError):
        books.check_integrity()


# ---- spares: a parked session's emptied context, kept by its worker ----------------------------------


def _parked_with_spare(books: Books, session_id: str, n_ctx: int, charge: int) -> str:
    plan = books.plan_admission(charge, lambda _w: True, n_ctx=n_ctx)
    assert plan is not None
    session, _ = books.admit(plan, session_id=session_id, epoch=1, n_ctx=n_ctx, charge=charge, now=0.0)
    worker = session.worker_name
    freed, dropped = books.park(session, FakeSequence().state(0), kept=True)  # an empty sequence's state
    assert (freed, dropped) == (None, [])
    return worker


def test_a_kept_context_stays_charged_as_its_workers_spare_apart_from_the_sessions() -> None:
    books = Books(1000, ["w1", "w2"], spill=SpillStore(1 << 20))
    worker = _parked_with_spare(books, "a", 64, 300)
    assert books.state_of(worker) == "free" and books.spare_of(worker) == Spare(64, 300)
    assert (books.session_bytes, books.spare_bytes, books.budget.reserved, books.room) == (0, 300, 300, 1000)
    assert books.budget.charge_of(SpareOwner(worker)) == 300
    books.check_integrity()


def test_an_admission_takes_the_spare_of_its_n_ctx_and_the_spare_leaves_the_budget() -> None:
    books = Books(1000, ["w1", "w2"], spill=SpillStore(1 << 20))
    worker = _parked_with_spare(books, "a", 64, 300)
    other = next(w for w in books.free_workers() if w != worker)
    assert books.free_workers()[-1] == worker  # most recently freed, but:
    assert books.plan_admission(300, lambda _w: True, n_ctx=128).worker == other  # another n_ctx keeps the spare for its own
    plan = books.plan_admission(300, lambda _w: True, n_ctx=64)
    assert (plan.worker, plan.spares, plan.victims) == (worker, (), ())
    restored = books.table.get("a")
    books.take_blob(restored)
    assert books.unpark(plan, restored, 300) == []
    assert restored.worker_name == worker and books.spare_of(worker) is None
    assert (books.session_bytes, books.spare_bytes, books.budget.reserved) == (300, 0, 300)
    books.check_integrity()


def test_spares_are_the_first_room_an_admission_takes_before_any_eviction() -> None:
    books = Books(1000, ["w1", "w2", "w3"], spill=SpillStore(1 << 20))
    hot = []
    for name in ("a", "b"):  # both hot at once, then both parked: two spares
        session, _ = books.admit(books.plan_admission(400, lambda _w: True, n_ctx=64), session_id=name, epoch=1, n_ctx=64, charge=400, now=0.0)
        hot.append(session)
    kept = [session.worker_name for session in hot]
    for session in hot:
        assert books.park(session, FakeSequence().state(0), kept=True)[0] is None
    assert len(set(kept)) == 2 and books.spare_bytes == 800
    hot_plan = books.plan_admission(200, lambda _w: True, n_ctx=256)
    session, released = books.admit(hot_plan, session_id="c", epoch=1, n_ctx=256, charge=200, now=1.0)
    assert released == [] and session.worker_name not in kept  # the worker without a spare: both spares stay
    session.in_flight = 0
    assert (books.budget.available, books.room) == (0, 800)
    plan = books.plan_admission(700, lambda _w: True, n_ctx=512)  # more than one spare's room: both go, no eviction
    assert plan.victims == () and plan.worker in kept and set(plan.spares) == set(kept) - {plan.worker}
    new, released = books.admit(plan, session_id="d", epoch=1, n_ctx=512, charge=700, now=2.0)
    assert released == list(plan.spares) and all(books.state_of(w) == "in transit" for w in released)
    assert books.spare_bytes == 0 and books.session_bytes == 900 and books.table.get("c") is session
    books.check_integrity()


def test_taking_a_worker_for_other_work_prefers_one_without_a_spare_and_drops_the_spare() -> None:
    books = Books(1000, ["w1", "w2"], spill=SpillStore(1 << 20))
    worker = _parked_with_spare(books, "a", 64, 300)
    other = books.take(lambda _w: True)
    assert other != worker and books.spare_of(worker) is not None
    assert books.take(lambda _w: True) == worker and books.spare_of(worker) is None and books.spare_bytes == 0
    books.check_integrity()
    books.give_back(other)
    dead = _parked_with_spare(books, "b", 64, 300)
    assert books.take_unusable(lambda name: name != dead) == [dead] and books.spare_bytes == 0
    books.check_integrity()


def test_books_integrity_catches_a_spare_on_a_bound_worker_and_a_spare_without_its_charge() -> None:
    books = Books(1000, ["w1", "w2"], spill=SpillStore(1 << 20))
    worker = _parked_with_spare(books, "a", 64, 300)
    books.budget.release(SpareOwner(worker))
    with pytest.raises(IntegrityError):
        books.check_integrity()
    books.budget.reserve(SpareOwner(worker), 300)
    books.check_integrity()
    books._free.remove(worker)
    books._in_transit.add(worker)
    with pytest.raises(IntegrityError, match="spare"):
        books.check_integrity()
