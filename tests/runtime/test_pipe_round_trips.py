"""One pipe round trip for a supervisor append (issue 18, item 4), direct channels on: the run carries the
channel's binding, the worker revokes the channel on the run itself, and an admission's open travels with its
first run. The guarantees of README "The direct channel" hold: the binding the run carried serves the
session, a direct append that completed is the length the supervisor checks the next append against, and
the supervisor's other requests still revoke the channel before they act.

A real worker on the real first shard, driven through an in-process KvService; the commands it is sent are
counted at the one method that writes the pipe (WorkerProcess.call)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from kvpool.daemon.pool.pool import WorkerPool
from kvpool.daemon.service import KvService
from kvpool.wire.errors import RequestFailed
from kvpool.wire.framing import FRAME_HEADER, receive_exactly
from kvpool.wire.protocol import Append, AppendReply, Release, Truncate, decode_reply, encode
from tests.support.service import run_on_service
from workers.server.commands import CloseContext, RunAppend

pytestmark = pytest.mark.timeout(1800)


def _direct_append(address: str, request: Append):
    """One request on a worker's direct channel, as a client sends it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect("\0" + address)
        connection.sendall(encode(request))
        (size,) = FRAME_HEADER.unpack(receive_exactly(connection, FRAME_HEADER.size))
        return decode_reply(receive_exactly(connection, size))


def test_a_supervisor_append_is_one_pipe_command_admitting_or_not_with_direct_channels_on(shards, tmp_path, resource_tracker_running):

    async def scenario(service: KvService, pool: WorkerPool) -> None:
        assert service.config.uses_direct_channels
        await service.calibrator.calibrate(64)
        [worker] = pool.workers()
        sent: list[str] = []
        call = worker.call

        async def counted(command):
            sent.append(type(command).__name__)
            return await call(command)

        worker.call = counted

        async def append(start_pos: int, tokens: list[int]) -> tuple[AppendReply, list[str]]:
            sent.clear()
            reply = await service.append(Append(session_id="s", epoch=1, start_pos=start_pos, tokens=tokens, direct=True))
            return reply, list(sent)

        admitted, admitting_sent = await append(0, [1, 2, 3])
        plain, plain_sent = await append(3, [4])
        print(f"pipe commands: admitting append {admitting_sent}, plain append {plain_sent}")
        assert (admitted.admitted, admitted.length, plain.admitted, plain.length) == (True, 3, False, 4)
        assert admitted.channel and plain.channel == admitted.channel
        assert (len(admitting_sent), len(plain_sent)) == (1, 1), (admitting_sent, plain_sent)

        # The binding the run carried is live: the channel serves the session, and the supervisor's next
        # append is checked against the length that direct append left (still one command).
        direct = await asyncio.to_thread(_direct_append, plain.channel, Append(session_id="s", epoch=1, start_pos=4, tokens=[5]))
        assert isinstance(direct, AppendReply) and direct.length == 5
        with pytest.raises(RequestFailed) as stale:
            await append(4, [6])
        assert (stale.value.code, stale.value.length) == ("position_mismatch", 5)
        after_direct, after_direct_sent = await append(5, [6])
        assert (after_direct.length, len(after_direct_sent)) == (6, 1)

        # An append the supervisor refuses itself (the context would overflow) revokes the channel as it
        # did before it acted (the next direct append is channel_revoked); a truncate revokes it before it
        # acts (RevokeChannel, then TruncateContext).
        sent.clear()
        with pytest.raises(RequestFailed) as full:
            await service.append(Append(session_id="s", epoch=1, start_pos=6, tokens=list(range(1, 60)), direct=True))
        assert (full.value.code, full.value.length, sent) == ("context_full", 6, ["RevokeChannel"])
        revoked = await asyncio.to_thread(_direct_append, plain.channel, Append(session_id="s", epoch=1, start_pos=6, tokens=[7]))
        assert revoked.code == "channel_revoked"
        rebound, rebound_sent = await append(6, [7])
        assert (rebound.length, rebound.channel, len(rebound_sent)) == (7, plain.channel, 1)
        sent.clear()
        assert (await service.truncate(Truncate(session_id="s", epoch=1, length=2))).length == 2
        assert sent == ["RevokeChannel", "TruncateContext"]
        revoked = await asyncio.to_thread(_direct_append, plain.channel, Append(session_id="s", epoch=1, start_pos=2, tokens=[7]))
        assert revoked.code == "channel_revoked"
        service.check_integrity()

    run_on_service(shards[0].path, tmp_path, scenario, max_sessions=1, n_ctx=64, threads=1)


def test_a_binding_made_by_a_run_a_newer_epoch_fenced_meanwhile_is_revoked_before_the_lock_goes(shards, tmp_path, resource_tracker_running):
    """Append(s, 1, direct) runs on the worker; Release(s, 2) arrives meanwhile. Its fence finds the channel handed to the
    run (nothing to revoke) and waits for the session's lock; the run binds (s, 1) as it succeeds. Before the fix that
    binding stood until the fence's drop reached the worker, and an epoch-1 direct append was served after epoch 2 was
    seen; now the append checks the session live and current after its run, and the channel is revoked before the lock goes.
    The fence's drop (CloseContext) is held back here, so nothing else can revoke the channel first."""

    async def scenario(service: KvService, pool: WorkerPool) -> None:
        await service.calibrator.calibrate(64)
        [worker] = pool.workers()
        admitted = await service.append(Append(session_id="s", epoch=1, start_pos=0, tokens=[1, 2, 3], direct=True))
        assert admitted.channel
        call = worker.call
        drop_may_go = asyncio.Event()
        releasing: list[asyncio.Task] = []

        async def fenced_during_the_run(command):
            if isinstance(command, CloseContext):
                await drop_may_go.wait()
            reply = await call(command)
            if isinstance(command, RunAppend) and command.bind is not None and not releasing:
                releasing.append(asyncio.create_task(service.release(Release(session_id="s", epoch=2))))
                for _ in range(5):
                    await asyncio.sleep(0)
                assert service.books.table.highest_epoch("s") == 2 and not releasing[0].done()  # fenced: waiting for the lock
            return reply

        worker.call = fenced_during_the_run
        try:
            superseded = await service.append(Append(session_id="s", epoch=1, start_pos=3, tokens=[4], direct=True))
        except RequestFailed as failure:
            superseded = failure
        late = await asyncio.to_thread(_direct_append, admitted.channel, Append(session_id="s", epoch=1, start_pos=4, tokens=[9]))
        assert not isinstance(late, AppendReply) and late.code == "channel_revoked", late
        assert isinstance(superseded, RequestFailed) and superseded.code == "stale_epoch", superseded  # its run's binding not handed out
        drop_may_go.set()
        assert (await releasing[0]).detail == "no state"  # epoch 1 went with the fence; epoch 2 has none
        assert service.books.table.get("s") is None
        service.check_integrity()

    run_on_service(shards[0].path, tmp_path, scenario, max_sessions=1, n_ctx=64, threads=1)
