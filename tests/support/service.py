"""A daemon's KvService on a real worker pool, in this process, without its socket: for tests that drive the
supervisor's logic directly and watch what crosses the pipe (a worker's `call` can be wrapped)."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Awaitable, Callable

from kvpool.daemon.config import ServeConfig
from kvpool.daemon.pool.pool import WorkerPool
from kvpool.daemon.service import KvService
from kvpool.daemon.supervisor import build_pool
from kvpool.shard.header import read_shard_info
from kvpool.wire.protocol import ShardDescription


def run_on_service(
    shard_path: pathlib.Path, tmp_path: pathlib.Path, scenario: Callable[[KvService, WorkerPool], Awaitable[None]], *,
    kinds: tuple[type, type] | None = None, **settings,
) -> None:
    """`await scenario(service, pool)` in a fresh event loop, on a KvService of ServeConfig(**settings) over the shard's
    started pool (`kinds`: the worker kinds, e.g. tests.support.fake_worker's; None: real workers); the service
    and the pool are closed whatever the scenario does."""
    config = ServeConfig(model=shard_path, socket=tmp_path / "unused.sock", **settings)
    pool = build_pool(config, read_shard_info(shard_path), kinds)

    async def started() -> None:
        ready = await asyncio.to_thread(pool.start)
        service = KvService(config, pool, ShardDescription(shape=ready.shape, model_path=str(shard_path)), ready.kv_bytes_per_position)
        try:
            await scenario(service, pool)
        finally:
            service.close()

    try:
        asyncio.run(started())
    finally:
        pool.close()
