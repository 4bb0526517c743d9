"""The daemon's books, the synchronous truth: sessions (hot or parked) and their epochs, the byte budget, which
worker serves which session, the spill store; checked together by Books.check_integrity."""

from kvpool.daemon.books.books import AdmissionPlan, Books
from kvpool.daemon.books.budget import ByteBudget
from kvpool.daemon.books.integrity import IntegrityError
from kvpool.daemon.books.sessions import EpochCheck, Session, SessionTable
from kvpool.daemon.books.spill import CorruptBlob, SpillStore

__all__ = ["AdmissionPlan", "Books", "ByteBudget", "CorruptBlob", "EpochCheck", "IntegrityError", "Session", "SessionTable", "SpillStore"]
