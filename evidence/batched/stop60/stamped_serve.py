"""`kvpool serve` with time stamps (perf_counter_ns, CLOCK_MONOTONIC) at the batched path's stages in the
supervisor: each Append request decoded, each RunBatch sent and answered, each AppendReply written.
Written to $STAMPS at exit."""
import atexit, json, os, sys, time
import kvpool.daemon.transport.frames as frames
import kvpool.daemon.pool.process as process
from kvpool.wire.protocol import Append, AppendReply
from workers.server.commands import RunBatch

stamps = []
now = time.perf_counter_ns
_decoded = frames.SocketTransport._decoded
def decoded(payload):
    request = _decoded(payload)
    if isinstance(request, Append):
        stamps.append(("req", now()))
    return request
frames.SocketTransport._decoded = staticmethod(decoded)

_replies_to = frames._replies_to
def replies_to(writer):
    send = _replies_to(writer)
    async def stamped(message):
        await send(message)
        if isinstance(message, AppendReply):
            stamps.append(("reply", now()))
    return stamped
frames._replies_to = replies_to

_call = process.WorkerProcess.call
async def call(self, command):
    batch = isinstance(command, RunBatch)
    if batch:
        stamps.append(("send", now()))
    try:
        return await _call(self, command)
    finally:
        if batch:
            stamps.append(("done", now()))
process.WorkerProcess.call = call

if __name__ == "__mp_main__":  # the worker (spawned: it imports this file as __mp_main__)
    import llama_cpp
    import workers.server.batched_server as bs
    wstamps = []
    _decode = llama_cpp.llama_decode
    def llama_decode(ctx, batch):
        wstamps.append(("dec<", now()))
        try:
            return _decode(ctx, batch)
        finally:
            wstamps.append(("dec>", now()))
    llama_cpp.llama_decode = llama_decode
    _handle = bs.BatchedWorkerServer.handle
    def handle(self, command):
        batch = isinstance(command, RunBatch)
        if batch:
            wstamps.append(("run<", now()))
        try:
            return _handle(self, command)
        finally:
            if batch:
                wstamps.append(("run>", now()))
    bs.BatchedWorkerServer.handle = handle
    atexit.register(lambda: json.dump(wstamps, open(os.environ["STAMPS"] + f".worker{os.getpid()}", "w")))

if __name__ == "__main__":
    atexit.register(lambda: json.dump(stamps, open(os.environ["STAMPS"], "w")))
    from kvpool.cli.main import main
    sys.argv = ["kvpool", *sys.argv[1:]]
    sys.exit(main())
