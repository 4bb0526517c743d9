"""--slow-reader: a connection to the last daemon that sends appends of its own session and never reads.

It speaks the protocol by hand (kvpool.wire.protocol): Hello, then appends of ROWS_PER_APPEND rows each at
consecutive positions until the session's n_ctx is full, ROUNDS times (epoch 1, 2, ...: each round
starts over at position 0 under the next epoch), every one asking for all rows of logits back
(ROWS_PER_APPEND x n_vocab x 4 bytes per reply: 3 MiB on the bundled model, ~288 MiB for all of them).
Bytes go out without blocking for as long as the socket takes them; no reply is ever read. A daemon
that keeps executing requests whose replies nobody reads holds every reply in memory; one that applies
backpressure stops reading that connection once its write buffer is full. The supervisor's RSS is
sampled throughout and must stay within RSS_BOUND_BYTES of its value before the first request, while
the other sessions continue. At the end the connection is closed and the session released at the epoch
after the last round (which also fences any request of the closed connection still queued in the daemon).
"""

from __future__ import annotations

import contextlib
import pathlib
import select
import socket
import threading
import time

import numpy as np
import psutil

from kvpool.client.client import Client, ConnectionLost, KvpoolError
from kvpool.stress.options import MiB
from kvpool.stress.report import SlowReaderRecord
from kvpool.wire.framing import receive_frame
from kvpool.wire.peers import peer_credentials
from kvpool.wire.protocol import MAX_REPLY_BYTES, PROTOCOL_VERSION, Append, Hello, HelloReply, OutputRows, decode_reply, encode

ROWS_PER_APPEND = 16
ROUNDS = 3
RSS_BOUND_BYTES = 48 * MiB  # measured here: +4 MiB over a run without the slow reader, +14 MiB with it
POLL_S = 0.1
QUIET_S = 5.0  # no byte taken and no append executed this long: the daemon stopped reading the connection
QUIET_CAP_S = 120.0
class SlowReader:
    def __init__(self, socket_path: pathlib.Path, daemon_index: int, session_id: str, n_ctx: int, seed: int) -> None:
        self.socket_path = socket_path
        self.session_id = session_id
        self._n_ctx = n_ctx
        self._seed = seed
        self._stop = threading.Event()
        self._sending_done = threading.Event()
        self._thread = threading.Thread(target=self._send_and_sample, name="kvpool-stress-slow-reader", daemon=True)
        self._sock: socket.socket | None = None
        self._frames: list[bytes] = []
        self._per_round = 1
        self._supervisor: psutil.Process | None = None
        self.record = SlowReaderRecord(daemon=daemon_index, supervisor_pid=0, session_id=session_id, rows_per_append=ROWS_PER_APPEND, reply_bytes_each=0, appends_planned=0, bound_bytes=RSS_BOUND_BYTES)

    def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(60)
        sock.connect(str(self.socket_path))
        self._sock = sock
        sock.sendall(encode(Hello(version=PROTOCOL_VERSION, client="stress-slow-reader")))
        payload = receive_frame(sock, MAX_REPLY_BYTES)
        if payload is None:
            raise ConnectionLost("the daemon closed the slow reader's connection during Hello")
        hello = decode_reply(payload)
        if not isinstance(hello, HelloReply):
            raise ConnectionLost(f"the slow reader's Hello was answered with {hello}")
        pid, _uid, _gid = peer_credentials(sock)
        self._supervisor = psutil.Process(pid)
        shard = hello.shard
        n_ctx = min(self._n_ctx, hello.default_n_ctx)
        rng = np.random.default_rng(self._seed)
        self._per_round = n_ctx // ROWS_PER_APPEND
        for number in range(ROUNDS * self._per_round):
            epoch, index = 1 + number // self._per_round, number % self._per_round
            common = dict(session_id=self.session_id, epoch=epoch, start_pos=index * ROWS_PER_APPEND, output_rows=OutputRows.ALL)
            if shard.shape.is_first:
                message = Append(tokens=[int(t) for t in rng.integers(0, shard.shape.n_vocab, ROWS_PER_APPEND)], **common)
            else:
                rows = (rng.standard_normal((ROWS_PER_APPEND, shard.shape.n_embd)) * 0.1).astype("<f4")
                message = Append(hidden=rows.tobytes(), **common)
            self._frames.append(encode(message))
        record = self.record
        record.supervisor_pid = pid
        record.reply_bytes_each = ROWS_PER_APPEND * (shard.shape.output_width) * 4
        record.appends_planned = len(self._frames)
        record.rss_before_bytes = record.rss_max_bytes = self._rss()
        sock.setblocking(False)
        self._thread.start()

    def _rss(self) -> int:
        try:
            rss = self._supervisor.memory_info().rss if self._supervisor is not None else 0
        except psutil.Error:
            return 0
        self.record.rss_max_bytes = max(self.record.rss_max_bytes, rss)
        return rss

    def _send_and_sample(self) -> None:
        """Send every frame, never read: until all are sent, or for QUIET_S neither did the socket take a
        byte nor did the daemon execute one more of them (it stopped reading). Sample the supervisor's RSS
        until stopped."""
        payload = memoryview(b"".join(self._frames))
        ends, total = [], 0
        for frame in self._frames:
            total += len(frame)
            ends.append(total)
        sent, progress_at, executed = 0, time.monotonic(), 0
        assert self._sock is not None
        try:
            with Client(self.socket_path, timeout_s=60, name="stress-slow-check") as client:
                while sent < total and not self._stop.is_set():
                    _readable, writable, _ = select.select([], [self._sock], [], POLL_S)
                    count = 0
                    if writable:
                        with contextlib.suppress(BlockingIOError, InterruptedError):
                            count = self._sock.send(payload[sent : sent + 65536])
                    now_executed = self._executed(client)
                    if count or now_executed != executed:
                        sent, executed, progress_at = sent + count, now_executed, time.monotonic()
                    elif time.monotonic() - progress_at >= QUIET_S:
                        self.record.send_blocked = True
                        break
                    self.record.appends_sent = sum(end <= sent for end in ends)
                    self._rss()
        except (ConnectionLost, KvpoolError, OSError) as error:
            self.record.detail = f"the slow reader's sending failed: {error}"
        finally:
            self._sending_done.set()
        while not self._stop.wait(POLL_S):
            self._rss()

    def _executed(self, client: Client) -> int:
        """How many of this connection's appends the daemon has executed (the session's epoch and length)."""
        row = next((r for r in client.stats().sessions if r.session_id == self.session_id), None)
        return 0 if row is None else (row.epoch - 1) * self._per_round + row.length // ROWS_PER_APPEND

    def finish(self) -> SlowReaderRecord:
        """After the other sessions ended: wait until the daemon stops executing this connection's
        appends, take the RSS, close the connection and release the session."""
        self._sending_done.wait(QUIET_CAP_S)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        record = self.record
        try:
            with Client(self.socket_path, timeout_s=60, name="stress-slow-check") as client:
                processed, changed_at, cap = -1, time.monotonic(), time.monotonic() + QUIET_CAP_S
                while True:
                    self._rss()
                    now = self._executed(client)
                    if now != processed:
                        processed, changed_at = now, time.monotonic()
                    if record.send_blocked or processed >= record.appends_sent or time.monotonic() - changed_at >= QUIET_S or time.monotonic() > cap:
                        break
                    time.sleep(POLL_S)
                record.appends_processed = max(processed, 0)
                record.rss_after_bytes = self._rss()
                self.close()
                record.released = self._release(client)
        except (ConnectionLost, KvpoolError, OSError) as error:
            record.detail = f"checking the slow reader's daemon failed: {error}"
        finally:
            self.close()
        return record

    def _release(self, client: Client) -> bool:
        for _ in range(50):
            client.release(self.session_id, ROUNDS + 1)  # fences whatever of the earlier epochs is still queued
            if not any(r.session_id == self.session_id for r in client.stats().sessions):
                return True
            time.sleep(POLL_S)
        return False

    def close(self) -> None:
        self._stop.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
            self.record.closed = True
