"""A route the router left unsettled, on fake workers in both modes: a truncate whose connection to the first
daemon is lost (as a drain's farewell in place of its reply loses it) stops there, the daemons after it still
holding the longer history; the router's next append truncates them all first and goes on exactly. The stress's
stale-epoch probe (kvpool.stress.probes.stale_request) judges a daemon of such a route against what it held
before the stale request, not against the router's length (CI on 430d27e: "stale release changed daemon 2:
epoch/length 1/17, expected 1/13" after a rolling restart's drain met a truncate), and against (epoch, length)
once the route is settled again."""

from __future__ import annotations

import types

import numpy as np
import pytest

from kvpool.client.client import ConnectionLost
from kvpool.router.router import Router
from kvpool.stress import probes
from kvpool.stress.errors import ContractViolation
from tests.support.contract import MODES, mode_flags, tokens
from tests.support.fake_worker import expected_rows

STALE_KINDS = ("append", "truncate", "release", "cancel")


class LosesItsNextTruncate:
    """A daemon's client whose next truncate fails as one lost to a drain does: ConnectionLost, nothing taken."""

    def __init__(self, client) -> None:
        self.client = client
        self.lose = True

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    def truncate(self, session_id: str, epoch: int, length: int) -> int:
        if self.lose:
            self.lose = False
            raise ConnectionLost("the daemon drained while the request was in flight (injected)")
        return self.client.truncate(session_id, epoch, length)


class Aimed:
    """The probe's random choices, fixed: this daemon, this kind of stale request."""

    def __init__(self, stage: int, kind: str) -> None:
        self.stage, self.kind = stage, kind

    def randrange(self, _stop: int) -> int:
        return self.stage

    def choice(self, kinds):
        assert self.kind in kinds
        return self.kind


def _lengths(clients) -> list[int]:
    return [next(row.length for row in client.stats().sessions if row.session_id == "cut") for client in clients]


def _probe_every_daemon(session, clients, history) -> None:
    """A stale request of every kind to every daemon, through the stress's own probe."""
    for stage in range(len(clients)):
        for kind in STALE_KINDS:
            state = types.SimpleNamespace(
                session_id="cut", epoch=session.epoch, length=session.length, tokens=list(history), clients=clients,
                rng=Aimed(stage, kind), options=types.SimpleNamespace(may_lose_state=False), session=session,
            )
            probes.stale_request(state)


@pytest.mark.parametrize("mode", MODES)
def test_a_truncate_lost_on_the_first_daemon_is_finished_by_the_next_append(serve, fake_shards, mode):
    daemons = [serve(path, *mode_flags(mode), name=f"cut{index}") for index, path in enumerate(fake_shards)]
    clients = [daemon.client() for daemon in daemons]
    try:
        session = Router([LosesItsNextTruncate(clients[0]), *clients[1:]]).session("cut", epoch=2)
        session.append([3, 1, 4, 1, 5, 9])
        assert session.settled
        session.truncate(3)  # lost on daemon 0: the router stops there and leaves the rest to the next append
        assert session.length == 3 and not session.settled
        assert _lengths(clients) == [6, 6, 6]
        _probe_every_daemon(session, clients, [3, 1, 4])  # each left as it was (6), not judged against the router's 3
        assert _lengths(clients) == [6, 6, 6]

        logits = session.append([2, 6])
        assert session.settled and _lengths(clients) == [5, 5, 5]
        rows = tokens(3, 1, 4, 2, 6)
        for client in clients:
            rows = expected_rows(client.hello.shard.shape, rows, output_rows="all")
        assert np.array_equal(logits[-1], rows[-1])  # positions 3 and 4 are 2 and 6, not the truncated 1 and 5
        _probe_every_daemon(session, clients, [3, 1, 4, 2, 6])  # settled: every daemon must hold (epoch, 5)
        session.release()
    finally:
        for client in clients:
            client.close()


def test_the_probe_still_fails_a_daemon_that_holds_other_than_a_settled_route_says(serve, fake_shards):
    """The probe is not made blind: with the route settled, a daemon holding another length fails it, and one holding
    nothing."""
    daemons = [serve(path, name=f"odd{index}") for index, path in enumerate(fake_shards)]
    clients = [daemon.client() for daemon in daemons]
    try:
        session = Router(clients).session("cut", epoch=2)
        session.append([3, 1, 4, 1, 5, 9])
        clients[2].truncate("cut", 2, 4)  # behind the router's back
        assert session.settled and _lengths(clients) == [6, 6, 4]
        with pytest.raises(ContractViolation, match="changed daemon 2: epoch/length 2/4, expected 2/6"):
            _probe_every_daemon(session, clients, [3, 1, 4, 1, 5, 9])
        clients[2].release("cut", 2)  # gone from daemon 2, the route still settled: the probe says so
        with pytest.raises(ContractViolation, match="gone from daemon 2 after a stale"):
            _probe_every_daemon(session, clients, [3, 1, 4, 1, 5, 9])
        session.release()
    finally:
        for client in clients:
            client.close()
