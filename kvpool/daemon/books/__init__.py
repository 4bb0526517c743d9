"""The daemon's books, the synchronous truth: sessions (hot or parked) and their epochs, the byte budget, which
worker serves which session, the spill store; checked together by Books.check_integrity."""
