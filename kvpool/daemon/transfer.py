"""Export and Import: a session's sealed state (kvpool.state.header: this daemon's identity, the session, its
length, a CRC-32C) leaves through the socket in chunks, and comes in, from any daemon whose shard has the same
identity, as a new parked session. The bytes travel through the caller: moving them between hosts is the
relay's job. Fenced like every session request.

Consistency: an Export at offset 0 saves the state once (a hot session is saved without being parked, and
stays hot; a parked one is read from the store) and keeps it (kvpool.daemon.books.in_transit.ExportCache);
its later chunks are cut from that copy only, named by export_id, while the session stays live at that epoch.
Each export stands until its last chunk was handed out or it sat idle (kvpool.daemon.books.in_transit): another
caller's export of the same session never cuts it short; past the daemon's limit a new export is over_budget
with retry_after_s.

An imported state is untrusted: it is opened with this daemon's identity before anything is admitted. Another
shard's, build's or layout's state is cache_miss with reason identity_mismatch (the caller replays instead);
a failed checksum, a truncated or undecodable state, a header beyond --n-ctx, chunks out of order or a total
that changes or exceeds the cap are bad_request. A refused import leaves the books as they were. What llama.cpp
would restore is checked when the state is restored, as every parked state's (Books.take_blob): bytes it
refuses, or cells that do not hold positions [0, length) once each, are cache_miss restore_failed then.
"""

from __future__ import annotations

import time

from kvpool.daemon.books.books import Books
from kvpool.daemon.books.in_transit import ExportCache, ExportsFull, ImportBuffers, KeptExport, TransferRefused
from kvpool.daemon.books.sessions import Session
from kvpool.daemon.config import ServeConfig
from kvpool.daemon.gate import Gate
from kvpool.daemon.metrics import Metrics
from kvpool.daemon.warm import WarmRequests
from kvpool.state.header import IDENTITY, StateHeader, StateRejected, open_state
from kvpool.wire.checks import check_session_fields
from kvpool.wire.errors import RequestFailed
from kvpool.wire.protocol import Done, ErrorCode, Export, Exported, Import, MissReason


def _bad(message: str) -> RequestFailed:
    return RequestFailed(ErrorCode.BAD_REQUEST, message)


class Transfers:
    def __init__(self, config: ServeConfig, books: Books, gate: Gate, warm: WarmRequests, metrics: Metrics) -> None:
        self.config = config
        self.books = books
        self.gate = gate
        self.warm = warm
        self.metrics = metrics
        self.exports = ExportCache()
        self.imports = ImportBuffers(min(config.max_import_bytes, config.spill_limit_bytes + config.spill_disk_budget_bytes) or 1)

    # ---- export ------------------------------------------------------------------------------------

    async def export(self, request: Export) -> Exported:
        check_session_fields(request.session_id, request.epoch, self.gate.length_of(request.session_id, request.epoch))
        if request.offset < 0 or (request.offset == 0) != (request.export_id == 0):
            raise _bad("an export starts at offset 0 with export_id 0; its later chunks name the export_id offset 0 answered")
        await self.gate.fence(request.session_id, request.epoch)
        session = self.books.table.get(request.session_id)
        if session is None or session.epoch != request.epoch:
            self.exports.drop(request.session_id)
            raise self.gate.miss(request.session_id, request.epoch, "no state for this session")
        kept = await self._saved(session) if request.offset == 0 else self._kept(request)
        try:
            chunk = kept.chunk(request.offset, self.config.export_chunk_bytes)
        except TransferRefused as refused:
            raise _bad(str(refused)) from None
        self.metrics.count("export_chunks")
        return Exported(
            session_id=request.session_id, epoch=request.epoch, state=chunk,
            offset=request.offset, total_bytes=len(kept.state), length=kept.length, export_id=kept.export_id,
        )

    async def _saved(self, session: Session) -> KeptExport:
        payload, length = await self.warm.saved_state(session)
        self.gate.check_live(session)  # nothing of a session that ended, or went stale, while it was saved
        try:
            kept = self.exports.keep(session.session_id, session.epoch, self.books.sealing.seal(session, payload, length=length), length)
        except ExportsFull as full:
            raise RequestFailed(ErrorCode.OVER_BUDGET, str(full), retry_after_s=full.retry_after_s) from None
        self.metrics.count("exports")
        return kept

    def _kept(self, request: Export) -> KeptExport:
        try:
            kept = self.exports.find(request.session_id, request.epoch, request.export_id)
        except TransferRefused as refused:
            raise _bad(str(refused)) from None
        return kept

    # ---- import ------------------------------------------------------------------------------------

    async def import_(self, request: Import) -> Done:
        check_session_fields(request.session_id, request.epoch, self.gate.length_of(request.session_id, request.epoch))
        self.warm.require_tier("import")
        await self.gate.fence(request.session_id, request.epoch)
        self._refuse_existing(request)
        try:
            partial = self.imports.add(request.session_id, request.epoch, request.offset, request.total_bytes, request.state)
        except TransferRefused as refused:
            raise _bad(str(refused)) from None
        self.metrics.count("import_chunks")
        if not partial.complete:
            return Done(length=0, session_id=request.session_id, epoch=request.epoch, detail=f"received {len(partial.received)} of {partial.total_bytes} bytes")
        header, payload = self._opened(self.imports.take(request.session_id))
        session = Session(
            session_id=request.session_id, epoch=request.epoch, n_ctx=header.n_ctx, charged_bytes=0, worker_name="",
            length=header.length, last_used=time.monotonic(),
        )
        self.warm.add_parked(session, payload, "the imported state", "the imported state")
        self.metrics.count("imports")
        return Done(length=session.length, session_id=session.session_id, epoch=session.epoch, detail="imported")

    def _refuse_existing(self, request: Import) -> None:
        if self.books.table.get(request.session_id) is not None:
            self.imports.drop(request.session_id)
            raise _bad(f"session {request.session_id!r} already holds state at epoch {request.epoch}: release it first")

    def _opened(self, state: bytes) -> tuple[StateHeader, bytes]:
        """The header and payload of an imported state that this daemon may restore; else the typed error."""
        try:
            header, payload = open_state(state, self.books.sealing.identity)
        except StateRejected as rejected:
            if rejected.reason == IDENTITY:
                self.metrics.count_miss(MissReason.IDENTITY_MISMATCH)
                raise RequestFailed(ErrorCode.CACHE_MISS, f"the imported state is not this shard's: {rejected}", reason=MissReason.IDENTITY_MISMATCH) from None
            raise _bad(f"the imported state is refused ({rejected.reason}): {rejected}") from None
        if not 0 <= header.length <= header.n_ctx <= self.config.n_ctx:
            raise _bad(f"the imported state holds {header.length} positions of n_ctx {header.n_ctx}: this daemon's --n-ctx is {self.config.n_ctx}")
        return header, payload
