"""The stress's client of one daemon, as kvpool.router.router uses it: every request passes through to a plain
Client, and the session driver sees each append, truncate and release go out and come back (faults and
cancels are aimed there, error replies and admission waits counted there), a lost connection explained
by a drill is reconnected there, and a truncate or release answered with the wrong length is a contract
violation there."""

from __future__ import annotations

import time
from typing import Protocol

from kvpool.client.client import AppendResult, Client, ConnectionLost, KvpoolError
from kvpool.stress.errors import ContractViolation
from kvpool.wire.protocol import Done, ErrorCode, StatsReply


class Reconnected(ConnectionLost):
    """The connection to a daemon a drill restarted was lost; the tap has reconnected to it."""


class Tap(Protocol):
    """What the session driver does around each request to daemon `stage`."""

    session_id: str

    def sending(self, stage: int, start_pos: int, rows: int) -> None: ...
    def answered(self, stage: int, error: KvpoolError | None, *, admitted: bool = False, waited_s: float = 0.0, restored: bool = False) -> None: ...
    def lost(self, stage: int, error: ConnectionLost) -> None: ...


class TappedClient:
    def __init__(self, stage: int, client: Client, tap: Tap) -> None:
        self.stage = stage
        self.client = client
        self.tap = tap
        self._admitting_since: float | None = None  # the first try of the admission in progress here

    @property
    def shard(self):
        return self.client.shard

    @property
    def socket_path(self) -> str:
        return self.client.socket_path

    @property
    def hello(self):
        return self.client.hello

    def _call(self, request):
        try:
            return request(self.client)
        except ConnectionLost as error:
            self.tap.lost(self.stage, error)  # reconnects, or raises if no drill explains the loss
            raise Reconnected(str(error)) from error

    def append(self, session_id: str, epoch: int, start_pos: int, **options) -> AppendResult:
        rows = len(options["tokens"]) if options.get("tokens") is not None else len(options["hidden"])
        if start_pos == 0 and self._admitting_since is None:
            self._admitting_since = time.monotonic()
        self.tap.sending(self.stage, start_pos, rows)
        try:
            result = self._call(lambda client: client.append(session_id, epoch, start_pos, **options))
        except KvpoolError as error:
            if error.code != ErrorCode.OVER_BUDGET:
                self._admitting_since = None
            self.tap.answered(self.stage, error)
            raise
        except ConnectionLost:
            self._admitting_since = None
            raise
        since, self._admitting_since = self._admitting_since, None
        waited = time.monotonic() - since if since is not None and result.admitted else 0.0
        self.tap.answered(self.stage, None, admitted=result.admitted, waited_s=waited, restored=result.restored)
        return result

    def truncate(self, session_id: str, epoch: int, length: int) -> int:
        kept = self._answered(lambda client: client.truncate(session_id, epoch, length))
        if kept != length:
            raise ContractViolation(f"{session_id}: truncate({length}) on daemon {self.stage} answered length {kept}")
        return kept

    def release(self, session_id: str, epoch: int) -> Done:
        done = self._answered(lambda client: client.release(session_id, epoch))
        if done.length != 0:
            raise ContractViolation(f"{session_id}: release on daemon {self.stage} answered length {done.length}")
        return done

    def cancel(self, session_id: str, epoch: int) -> Done:
        """Passed through (the drills send cancels from their own thread and judge every answer)."""
        return self.client.cancel(session_id, epoch)

    def export_state(self, session_id: str, epoch: int) -> bytes:
        """A re-plan's export (kvpool.router.move), answered like every request."""
        return self._answered(lambda client: client.export_state(session_id, epoch))

    def import_state(self, session_id: str, epoch: int, state: bytes) -> int:
        return self._answered(lambda client: client.import_state(session_id, epoch, state))

    def lookup_prefix(self, scope: str, digests: list[bytes]) -> int:
        """The router's prefix lookup (kvpool.router.prefix), passed through."""
        return self._call(lambda client: client.lookup_prefix(scope, digests))

    def admit_prefix(self, session_id: str, epoch: int, scope: str, digests: list[bytes], *, n_ctx: int = 0) -> int:
        """The router's admission from a stored prefix, answered like every request (a cache_miss prefix_evicted counted)."""
        return self._answered(lambda client: client.admit_prefix(session_id, epoch, scope, digests, n_ctx=n_ctx))

    def stats(self) -> StatsReply:
        return self._call(lambda client: client.stats())

    def _answered(self, request):
        try:
            return self._call(request)
        except KvpoolError as error:
            self.tap.answered(self.stage, error)
            raise

    def close(self) -> None:
        self.client.close()
