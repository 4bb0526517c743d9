"""Making a session hot: room from free workers, budget and idle sessions (parked or evicted), the first-come
first-served line, residency, and what a session of an n_ctx is charged."""
