"""`kvpool serve`: the shard daemon. The supervisor wires the transport (transport/), the request semantics
(service, gate, warm), the books (books/), the worker processes (pool/) and admission (admission/)."""
