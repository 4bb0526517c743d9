"""The worker process: its main loop (main.py), the server of one session's context or of a batched context,
the pipe's commands, the direct channel, and the bound on workers computing at once."""
