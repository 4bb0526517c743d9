"""Making a session hot: room from free workers, budget and idle sessions (parked or evicted), the first-come
first-served line, residency, and what a session of an n_ctx is charged."""

from kvpool.daemon.admission.admission import MAX_ADMIT_WAIT_S, Admission

__all__ = ["MAX_ADMIT_WAIT_S", "Admission"]
