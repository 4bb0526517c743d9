"""Protocol fuzzing: malformed and invalid frames, interleaved with a live session's valid traffic.

Two daemons serve the first two shards of the bundled model ([0, 10) takes token ids, [10, 20) takes
hidden states). A live session runs through both; between its appends hypothesis sends garbage
payloads, random MessagePack, real tags with wrong field types, unknown tags, absurd and truncated
lengths, out-of-vocabulary tokens, hidden states of the wrong shape, negative and huge positions and
epochs, stale epochs and position mismatches on the live session itself. Every frame must get a typed
error reply (or a harmless valid one), or have its connection closed where the protocol says so; the
daemons must stay up; and the live session's next rows must equal an in-process run with the same
appends, bit for bit.
"""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from kvpool.client.client import Client
from kvpool.wire.framing import FRAME_HEADER
from kvpool.wire.protocol import (
    DEFAULT_MAX_REQUEST_BYTES,
    PROTOCOL_VERSION,
    Append,
    Cancel,
    Done,
    ErrorCode,
    ErrorReply,
    Hello,
    Release,
    Stats,
    StatsReply,
    Truncate,
    decode_request,
    encode,
)
from tests.conftest import EVEN_SPLIT
from tests.support.chains import daemon_chain
from tests.support.daemons import RawConnection, private_socket_dir
from workers.runtime.model import ShardModel

N_CTX = 512
N_VOCAB = 49152
N_EMBD = 576
LIVE_ID = "live"
LIVE_EPOCH = 5  # epochs 0..4 are stale for the live session
WRAP_AT = 440  # the live session is truncated back to KEEP when it gets this long (valid traffic too)
KEEP = 48
UINT64_MAX = 2**64 - 1
TAGS = ("Hello", "Append", "Truncate", "Release", "Cancel", "Stats", "Shutdown")
FIELDS = {  # every request may also carry the client's request_id
    "Hello": ("version", "client", "request_id"),
    "Append": ("session_id", "epoch", "start_pos", "tokens", "hidden", "output_rows", "n_ctx", "admit_timeout_s", "request_id"),
    "Truncate": ("session_id", "epoch", "length", "request_id"),
    "Release": ("session_id", "epoch", "request_id"),
    "Cancel": ("session_id", "epoch", "request_id"),
    "Stats": ("request_id",),
    "Shutdown": ("request_id",),
}
TYPED = {code.value for code in ErrorCode} - {ErrorCode.INTERNAL.value}
HANG_GUARD_S = 300  # a reply here takes milliseconds; this only stops a hung daemon from hanging the suite
FUZZ_TIMEOUT_S = 3600  # the whole fuzzing run takes ~10 s on 2 quiet cores; hang guard only


# ---- the daemons, the live session and its in-process reference ----------------------------------------


@pytest.fixture(scope="module")
def fuzz_shards(shard_sets):
    return shard_sets[EVEN_SPLIT][:2]


@pytest.fixture(scope="module")
def fuzz_daemons(fuzz_shards, tmp_path_factory):
    directory = private_socket_dir(tmp_path_factory.mktemp("fuzz"))
    with daemon_chain([shard.path for shard in fuzz_shards], directory, "fuzz", "--threads", "1", "--n-ctx", str(N_CTX), "--max-sessions", "2") as daemons:
        yield daemons


class LiveSession:
    """The valid traffic: one session through both daemons, and the same appends in process."""

    def __init__(self, daemons, shards, tokens: list[int]) -> None:
        self.clients = [daemon.client(name="fuzz-live") for daemon in daemons]
        self.models = [ShardModel(shard.path) for shard in shards]
        self.contexts = [model.new_context(N_CTX) for model in self.models]
        self.tokens = tokens
        self.length = 0
        self.steps = 0
        self.fuzzed = False  # set once a whole fuzzing run has gone through this session

    def restart(self, rows: int) -> None:
        """Start the session again from position 0 (after a release), on the daemons and in process."""
        for context in self.contexts:
            context.close()
        self.contexts = [model.new_context(N_CTX) for model in self.models]
        self.length = 0
        self.step(rows)

    def step(self, rows: int) -> None:
        if self.length + rows > WRAP_AT:
            for client in self.clients:
                assert client.truncate(LIVE_ID, LIVE_EPOCH, KEEP) == KEEP
            for context in self.contexts:
                context.truncate(KEEP)
            self.length = KEEP
        chunk = np.asarray([self.tokens[(self.length + i) % len(self.tokens)] for i in range(rows)], np.int32)
        first = self.clients[0].append(LIVE_ID, LIVE_EPOCH, self.length, tokens=chunk)
        second = self.clients[1].append(LIVE_ID, LIVE_EPOCH, self.length, hidden=first.rows)
        expected_first = self.contexts[0].append(self.length, tokens=chunk)
        expected_second = self.contexts[1].append(self.length, hidden=expected_first)
        assert np.array_equal(first.rows, expected_first), f"live session diverged on daemon 0 at {self.length}"
        assert np.array_equal(second.rows, expected_second), f"live session diverged on daemon 1 at {self.length}"
        self.length += rows
        assert first.length == second.length == self.length
        self.steps += 1

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for context in self.contexts:
            context.close()
        for model in self.models:
            model.close()


FIRST_ROWS = 8


@pytest.fixture(scope="module")
def live(fuzz_daemons, fuzz_shards, prompt_ids):
    """The live session, 8 rows long; every test leaves it live on both daemons (it may be longer)."""
    session = LiveSession(fuzz_daemons, fuzz_shards, prompt_ids[1])
    session.step(FIRST_ROWS)
    yield session
    session.close()


# ---- what gets sent ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Expect:
    """What a frame must get: one of `codes` (error replies), or one of `replies` (valid harmless ones)."""

    codes: frozenset[str] = frozenset()
    replies: tuple[type, ...] = ()
    closes: bool = False  # the daemon then closes this connection
    no_reply: bool = False  # we close first (a truncated frame): only the daemon's survival is checked


BAD = Expect(codes=frozenset({"bad_request"}))


@dataclasses.dataclass(frozen=True)
class Malformed:
    """Bytes that are not a valid request: garbage, random MessagePack, wrong types, unknown tags."""

    daemon: int
    payload: bytes


@dataclasses.dataclass(frozen=True)
class Framing:
    daemon: int
    kind: str  # "absurd", "truncated", "empty", "before_hello", "bad_version", "hello_again"
    size: int = 0
    payload: bytes = b""


@dataclasses.dataclass(frozen=True)
class Semantic:
    """A well-formed request the daemon must refuse (or answer harmlessly), resolved against the live state."""

    kind: str
    daemon: int
    value: int = 0
    other: int = 0
    session: str = "fuzz-0"
    blob: bytes = b""


@dataclasses.dataclass(frozen=True)
class LiveStep:
    rows: int


def _decodes(payload: bytes) -> bool:
    try:
        decode_request(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return True


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), UINT64_MAX) | st.floats() | st.text(max_size=12) | st.binary(max_size=24),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=10,
)


@st.composite
def tagged_dicts(draw) -> dict:
    tag = draw(st.sampled_from(TAGS + ("Nope", "", "append", "Stats ")))
    fields = FIELDS.get(tag, ("session_id", "x"))
    chosen = draw(st.lists(st.sampled_from(fields) if fields else st.just("extra"), max_size=len(fields) + 1, unique=True))
    value = {"type": tag} | {name: draw(msgpack_values) for name in chosen}
    if draw(st.booleans()):
        value[draw(st.text(max_size=8))] = draw(msgpack_values)  # unknown field
    return value


malformed = st.builds(
    Malformed,
    daemon=st.integers(0, 1),
    payload=st.one_of(
        st.binary(max_size=300),
        msgpack_values.map(msgspec.msgpack.encode),
        tagged_dicts().map(msgspec.msgpack.encode),
    ).filter(lambda payload: not _decodes(payload)),  # never a valid request (no Shutdown, no valid Release)
)

framing = st.one_of(
    st.builds(Framing, daemon=st.integers(0, 1), kind=st.just("absurd"), size=st.integers(DEFAULT_MAX_REQUEST_BYTES + 1, 2**32 - 1)),
    st.builds(Framing, daemon=st.integers(0, 1), kind=st.just("truncated"), size=st.integers(1, 5000), payload=st.binary(max_size=200)),
    st.builds(Framing, daemon=st.integers(0, 1), kind=st.sampled_from(["empty", "hello_again", "bad_version"]), size=st.integers(-5, 5)),
    st.builds(Framing, daemon=st.integers(0, 1), kind=st.just("before_hello"), payload=st.binary(max_size=100)),
)

SEMANTIC_KINDS = (
    "oov_tokens", "hidden_to_token_shard", "tokens_to_hidden_shard", "wrong_hidden_shape", "tokens_and_hidden",
    "empty_rows", "too_many_rows", "negative_start", "huge_start", "bad_epoch", "stale_epoch", "position_mismatch",
    "truncate_beyond", "negative_truncate", "unknown_session", "bad_session_id", "bad_n_ctx", "harmless",
)
semantic = st.builds(
    Semantic,
    kind=st.sampled_from(SEMANTIC_KINDS),
    daemon=st.integers(0, 1),
    value=st.integers(0, 2**62),
    other=st.integers(-8, 8),
    session=st.sampled_from([LIVE_ID, "fuzz-0", "fuzz-1"]),
    blob=st.binary(max_size=64),
)

steps = st.lists(st.one_of(semantic, malformed, semantic, framing, st.builds(LiveStep, rows=st.integers(1, 4))), min_size=1, max_size=6)

# Always run, whatever hypothesis draws: every semantic kind on the live session and on another id, with
# both signs of `other`, and every framing kind on both daemons.
EVERY_SEMANTIC = [
    [Semantic(kind=kind, daemon=(i + j) % 2, value=3 + 7 * i, other=sign * (1 + (i + j) % 4), session=session) for i, kind in enumerate(SEMANTIC_KINDS)] + [LiveStep(2)]
    for j, (session, sign) in enumerate([(LIVE_ID, 1), (LIVE_ID, -1), ("fuzz-0", 1), ("fuzz-0", -1)])
]
EVERY_FRAMING = [step for d in (0, 1) for step in [
    Framing(daemon=d, kind="absurd", size=2**32 - 1), Framing(daemon=d, kind="truncated", size=100, payload=b"\x81\xa4type"),
    Framing(daemon=d, kind="empty"), Framing(daemon=d, kind="hello_again"), Framing(daemon=d, kind="bad_version", size=-1),
    Framing(daemon=d, kind="before_hello", payload=encode(Stats())[4:]), LiveStep(1),
    Malformed(daemon=d, payload=b"\x82\xa4type\xa6Append\xaasession_id\x05"), Malformed(daemon=d, payload=b"\x81\xa4type\xa4Nope"),
]]


def _append(daemon: int, session: str, epoch: int, start: int, rows: int = 1, **fields) -> Append:
    """A valid-looking append for `daemon` (tokens for 0, hidden for 1) unless fields override."""
    if "tokens" not in fields and "hidden" not in fields:
        if daemon == 0:
            fields["tokens"] = [1] * rows
        else:
            fields["hidden"] = np.zeros((rows, N_EMBD), "<f4").tobytes()
    return Append(session_id=session, epoch=epoch, start_pos=start, **fields)


def resolve(case: Semantic, live_length: int) -> tuple[int, bytes, Expect]:
    """(daemon, frame, expectation) for `case` given the live session's length now.

    Invariant: no frame built here is a valid state change of the live session (that would be valid
    traffic, not fuzz): each carries an invalid field, a stale epoch or a wrong position. Epochs above
    LIVE_EPOCH are never sent for the live session (they would, rightly, release it).
    """
    d, live, session, epoch = case.daemon, live_length, case.session, LIVE_EPOCH
    start = live if session == LIVE_ID else case.value % 50
    missing = Expect(codes=frozenset({"cache_miss", "stale_epoch"}))  # no state, or an epoch seen higher before
    zeros = np.zeros((1, N_EMBD), "<f4").tobytes()
    match case.kind:
        case "oov_tokens":
            bad_token = N_VOCAB + case.value % 1000 if case.other >= 0 else -1 - case.value % 1000
            return 0, encode(_append(0, session, epoch, start, tokens=[1, bad_token])), BAD
        case "hidden_to_token_shard":
            return 0, encode(_append(0, session, epoch, start, hidden=zeros)), BAD
        case "tokens_to_hidden_shard":
            return 1, encode(_append(1, session, epoch, start, tokens=[1, 2])), BAD
        case "wrong_hidden_shape":
            size = 1 + case.value % (3 * N_EMBD * 4)
            size += size % (N_EMBD * 4) == 0
            filler = (case.blob or b"\0") * (size // max(1, len(case.blob)) + 1)
            return 1, encode(_append(1, session, epoch, start, hidden=filler[:size])), BAD
        case "tokens_and_hidden":
            return d, encode(_append(d, session, epoch, start, tokens=[1], hidden=zeros)), BAD
        case "empty_rows":
            return d, encode(_append(d, session, epoch, start, tokens=[]) if d == 0 else _append(d, session, epoch, start, hidden=b"")), BAD
        case "too_many_rows":
            return d, encode(_append(d, session, epoch, start, rows=N_CTX + 1 + case.value % 8)), BAD
        case "negative_start":
            return d, encode(_append(d, session, epoch, -1 - case.value)), BAD
        case "huge_start":
            huge = 2**32 + case.value if case.other >= 0 else UINT64_MAX - case.value % 1000
            expect = Expect(codes=frozenset({"position_mismatch"})) if session == LIVE_ID else missing
            return d, encode(_append(d, session, epoch, huge)), expect
        case "bad_epoch":
            bad_epoch = -1 - case.value if case.other < 0 else 2**63 + case.value
            requests = (_append(d, session, bad_epoch, start), Truncate(session_id=session, epoch=bad_epoch, length=0),
                        Release(session_id=session, epoch=bad_epoch), Cancel(session_id=session, epoch=bad_epoch))
            return d, encode(requests[abs(case.other) % 4]), BAD
        case "stale_epoch":
            stale = case.value % LIVE_EPOCH
            requests = (_append(d, LIVE_ID, stale, live), Truncate(session_id=LIVE_ID, epoch=stale, length=0),
                        Release(session_id=LIVE_ID, epoch=stale), Cancel(session_id=LIVE_ID, epoch=stale))
            return d, encode(requests[abs(case.other) % 4]), Expect(codes=frozenset({"stale_epoch"}))
        case "position_mismatch":
            position = live + (case.other or 1)
            expect = BAD if position < 0 else Expect(codes=frozenset({"position_mismatch"}))
            return d, encode(_append(d, LIVE_ID, epoch, position)), expect
        case "truncate_beyond":
            beyond = Truncate(session_id=LIVE_ID, epoch=epoch, length=live + 1 + case.value % 1000)
            return d, encode(beyond), Expect(codes=frozenset({"position_mismatch"}))
        case "negative_truncate":
            return d, encode(Truncate(session_id=session, epoch=epoch, length=-1 - case.value)), BAD
        case "unknown_session":
            unknown_epoch, position = case.value % 2**40, 1 + case.value % 100
            requests = (_append(d, "fuzz-unknown", unknown_epoch, position), Truncate(session_id="fuzz-unknown", epoch=unknown_epoch, length=position))
            return d, encode(requests[abs(case.other) % 2]), missing
        case "bad_session_id":
            name = "" if case.other % 2 else "s" * (257 + case.value % 100)
            return d, encode(_append(d, name, epoch, 0)), BAD
        case "bad_n_ctx":
            n_ctx = -1 - case.value if case.other < 0 else N_CTX + 1 + case.value
            return d, encode(_append(d, "fuzz-nctx", epoch, 0, n_ctx=n_ctx)), BAD
        case "harmless":
            index = abs(case.other) % 4
            if index == 0:
                return d, encode(Stats()), Expect(replies=(StatsReply,))
            if index == 1:  # nothing in flight: answered, nothing changes
                return d, encode(Cancel(session_id=LIVE_ID, epoch=LIVE_EPOCH)), Expect(replies=(Done,))
            never = (Release(session_id="fuzz-never", epoch=0), Truncate(session_id="fuzz-never", epoch=0, length=0))[index - 2]
            return d, encode(never), Expect(replies=(Done,))
    raise AssertionError(case.kind)


def frame_of(step, live_length: int) -> tuple[int, bytes, Expect, bool]:
    """(daemon, bytes, expectation, whether it goes on a fresh connection without Hello)."""
    match step:
        case Malformed(daemon=d, payload=payload):
            return d, FRAME_HEADER.pack(len(payload)) + payload, BAD, False
        case Framing(daemon=d, kind="absurd", size=size):
            return d, FRAME_HEADER.pack(size), dataclasses.replace(BAD, closes=True), False
        case Framing(daemon=d, kind="truncated", size=size, payload=payload):
            return d, FRAME_HEADER.pack(size + len(payload)) + payload, Expect(no_reply=True), False
        case Framing(daemon=d, kind="empty"):
            return d, FRAME_HEADER.pack(0), BAD, False
        case Framing(daemon=d, kind="hello_again"):
            return d, encode(Hello(version=PROTOCOL_VERSION)), BAD, False
        case Framing(daemon=d, kind="bad_version", size=size):
            return d, encode(Hello(version=PROTOCOL_VERSION + (size or 1))), dataclasses.replace(BAD, closes=True), True
        case Framing(daemon=d, kind="before_hello", payload=payload):
            frame = FRAME_HEADER.pack(len(payload)) + payload if not _is_hello(payload) else encode(Stats())
            return d, frame, dataclasses.replace(BAD, closes=True), True
        case Semantic():
            d, frame, expect = resolve(step, live_length)
            return d, frame, expect, False
    raise AssertionError(step)


def _is_hello(payload: bytes) -> bool:
    try:
        return isinstance(decode_request(payload), Hello)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False


def check_reply(reply, expect: Expect, description: str) -> None:
    assert reply is not None, f"connection closed instead of a reply to {description}"
    if isinstance(reply, ErrorReply):
        assert reply.code in TYPED, f"{description}: untyped error {reply}"
        assert reply.code in expect.codes, f"{description}: got {reply.code} ({reply.message}), expected one of {sorted(expect.codes)}"
    else:
        assert isinstance(reply, expect.replies), f"{description}: got {type(reply).__name__}, expected an error in {sorted(expect.codes)}"


# ---- the tests -----------------------------------------------------------------------------------------


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
@given(plan=steps, final_rows=st.integers(1, 3))
@example(plan=EVERY_SEMANTIC[0], final_rows=1)
@example(plan=EVERY_SEMANTIC[1], final_rows=2)
@example(plan=EVERY_SEMANTIC[2], final_rows=1)
@example(plan=EVERY_SEMANTIC[3], final_rows=3)
@example(plan=EVERY_FRAMING, final_rows=1)
def fuzz_the_live_session(fuzz_daemons, live, plan, final_rows):
    """One hypothesis example: the plan's frames, each checked, then the live session's continuation."""
    connections: dict[int, RawConnection] = {}
    try:
        for step in plan:
            if isinstance(step, LiveStep):
                live.step(step.rows)
                continue
            target, frame, expect, fresh = frame_of(step, live.length)
            event(f"{type(step).__name__}: {getattr(step, 'kind', '')}")
            daemon = fuzz_daemons[target]
            description = f"{step!r:.300}"
            if fresh:
                connection = RawConnection(daemon.socket, hello=False)
            else:
                connection = connections.get(target) or RawConnection(daemon.socket)
                connections[target] = connection
            connection.send(frame)
            if expect.no_reply:
                connection.close()
                connections.pop(target, None)
            else:
                check_reply(connection.read(), expect, description)
                if expect.closes:
                    assert connection.read() is None, f"{description}: the connection stayed open"
                    connection.close()
                    connections.pop(target, None)
                elif fresh:
                    connection.close()
            for each in fuzz_daemons:
                assert each.process.poll() is None, f"a daemon died after {description}:\n{each.log()}"
        live.step(final_rows)  # the continuation after the noise equals the run alone
    finally:
        for connection in connections.values():
            connection.close()


def fuzz_everything(fuzz_daemons, live) -> None:
    """The whole fuzzing run (the explicit examples plus 200 drawn plans) against the live session."""
    fuzz_the_live_session(fuzz_daemons, live)
    live.fuzzed = True


@pytest.mark.timeout(FUZZ_TIMEOUT_S)
def test_fuzzed_frames_get_typed_errors_and_never_touch_the_live_session(fuzz_daemons, live):
    fuzz_everything(fuzz_daemons, live)


@pytest.mark.timeout(FUZZ_TIMEOUT_S)
def test_after_fuzzing_only_the_live_session_is_left_and_the_books_balance(fuzz_daemons, live):
    if not live.fuzzed:  # run alone or first: drive the fuzzing whose aftermath this test checks
        fuzz_everything(fuzz_daemons, live)
    for index, daemon in enumerate(fuzz_daemons):
        with Client(daemon.socket, timeout_s=HANG_GUARD_S) as client:
            stats = client.stats()
            assert stats.integrity == "ok"
            assert [(row.session_id, row.epoch, row.length) for row in stats.sessions] == [(LIVE_ID, LIVE_EPOCH, live.length)]
            assert stats.counters["bad_requests"] > 10 and stats.counters["stale_epoch_rejects"] > 0
            assert stats.budget.reserved_bytes == stats.sessions[0].charged_bytes
        assert "Traceback" not in daemon.log(), daemon.log()
    assert live.steps > 100
    live.step(2)
    for client in live.clients:
        client.release(LIVE_ID, LIVE_EPOCH)
    for daemon in fuzz_daemons:
        with Client(daemon.socket, timeout_s=HANG_GUARD_S) as client:
            stats = client.stats()
            assert stats.sessions == [] and stats.budget.reserved_bytes == 0 and stats.integrity == "ok"
    live.restart(FIRST_ROWS)  # a released session admits again at 0: leave it as the fixture gave it
