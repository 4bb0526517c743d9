"""kvpool.AsyncClient on a real daemon that is SIGKILLed mid-request: every request in flight fails and the
next call finds nothing to reconnect to. The rest of the AsyncClient's contract (requests matched by id on one
connection, cancel on a lane of its own, a client that stops reading, replies to unknown ids) runs on fake
workers and toy servers: tests/unit/test_async_client.py. Waits are hang guards only (a stopped worker keeps
a request in flight on any machine)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from kvpool import AsyncClient
from kvpool.client.client import ConnectionLost
from tests.conftest import EVEN_SPLIT
from tests.support.daemons import DaemonProcess, exited, poll, run_async, wait_until

pytestmark = pytest.mark.timeout(3600)
N_CTX = 256
# Two compute slots: a session whose worker is stopped holds one, the others still compute.
OPTIONS = ("--threads", "2", "--n-ctx", str(N_CTX), "--max-sessions", "4")


@pytest.fixture(scope="module")
def first_shard(shard_sets):
    return shard_sets[EVEN_SPLIT][0]






def _worker_of(daemon, session_id: str) -> int:
    with daemon.client() as client:
        return next(row.worker_pid for row in client.stats().sessions if row.session_id == session_id)


def test_a_daemon_killed_mid_request_fails_every_pending_request_and_the_next_call_reconnects(first_shard, socket_dir, prompt_ids):
    daemon = DaemonProcess(first_shard.path, socket_dir / "killed.sock", *OPTIONS)
    workers = daemon.worker_pids()
    try:

        async def main():
            client = await AsyncClient.connect(daemon.socket)
            for index in range(2):
                await client.append(f"s{index}", 1, 0, tokens=prompt_ids[index][:4])
            pids = [_worker_of(daemon, f"s{index}") for index in range(2)]
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            try:
                pending = [asyncio.create_task(client.append(f"s{index}", 1, 4, tokens=[5, 6])) for index in range(2)]
                await poll(lambda: _all_in_flight(client), "both appends in flight")
                os.kill(daemon.process.pid, signal.SIGKILL)
                outcomes = await asyncio.gather(*pending, return_exceptions=True)

                async def refused():  # each call tries a new connection; once the daemon is gone, none opens
                    try:
                        await client.stats()
                    except ConnectionLost as error:
                        return "cannot connect" in str(error)
                    raise AssertionError("a killed daemon answered")

                await poll(refused, "connecting to the killed daemon to be refused")
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)  # they see their parent gone and exit
                await client.close()
            return outcomes

        outcomes = run_async(main())
        assert all(isinstance(outcome, ConnectionLost) for outcome in outcomes), outcomes
    finally:
        if daemon.process.poll() is None:
            daemon.process.kill()
        daemon.process.wait()
        wait_until(lambda: all(exited(pid) for pid in workers), "the killed daemon's workers to exit")
        daemon.socket.unlink(missing_ok=True)  # a killed daemon cannot remove its socket file
        daemon.stop()


async def _all_in_flight(client: AsyncClient) -> bool:
    rows = (await client.stats()).sessions
    return len(rows) == 2 and all(row.in_flight for row in rows)
