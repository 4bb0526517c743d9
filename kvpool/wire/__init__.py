"""The wire: every struct that crosses a socket (the daemon's, a worker's direct channel, a worker's pipe where
it carries the same structs), the checks a request passes, and the error it raises. Imported by the workers too,
so it stays light and imports nothing else of kvpool."""
