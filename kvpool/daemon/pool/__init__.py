"""The daemon's worker processes: each one's typed handle and process, their shared-memory segments, the
compute slots, the direct channels' supervisor side, and what happens to a worker between sessions."""
