"""The daemon's socket: the listening socket and its connection limit, framing with deadlines, the bound on
request bytes held across connections, and a connection's requests in flight."""
