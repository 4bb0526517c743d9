"""Running a layer range with llama.cpp: the loaded shard (model.py), one bounded context, several sessions as
sequences of one context, the C callbacks, a sequence's saved state, and picking the next token."""
