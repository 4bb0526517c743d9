"""kvpool.router: how a router embeds kvpool. A `Router` holds a checked route of shard daemons, the recovery
policy and the counts of all its sessions; each session walks its appends through the route, and what a
failure means is decided in one place (kvpool.router.session)."""
