"""Worker side of kvpool: one shard model, at most one bounded llama context. Knows nothing of budgets."""
