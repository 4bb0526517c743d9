"""The warm tier, end to end on real daemons: parked sessions come back exactly, without a cache miss."""

from __future__ import annotations

import os
import signal
import stat

import numpy as np
import pytest

from kvpool.client.client import KvpoolError
from kvpool.daemon.books import spill
from kvpool.daemon.books.spill import MAGIC
from tests.support.daemons import DaemonProcess, checked, in_thread, joined, refused, refused_start, stopped, wait_until
from tests.support.disks import OLD_MAGIC, failing_writes, own_files
from workers.runtime.model import ShardModel

N_CTX = 256
pytestmark = pytest.mark.timeout(3600)


class Reference:
    """The same appends, in one never-evicted context of the whole model in this process."""

    def __init__(self, model: ShardModel) -> None:
        self.context = model.new_context(N_CTX)

    def append(self, start: int, tokens) -> np.ndarray:
        return self.context.append(start, tokens=np.asarray(tokens, np.int32))

    def truncate(self, length: int) -> None:
        self.context.truncate(length)

    def close(self) -> None:
        self.context.close()


def _serve(model_path, socket_dir, name, *options):
    return DaemonProcess(model_path, socket_dir / f"{name}.sock", "--threads", "1", "--n-ctx", str(N_CTX), *options)






def test_four_sessions_on_two_places_park_and_restore_bit_identically(model_path, socket_dir, whole_model, prompt_ids):
    daemon = _serve(model_path, socket_dir, "four-on-two", "--max-sessions", "2")
    sessions = {f"s{index}": prompt_ids[index % len(prompt_ids)][: 6 + index] for index in range(4)}
    references = {name: Reference(whole_model) for name in sessions}
    try:
        with daemon.client() as client:
            lengths = {}
            for name, prompt in sessions.items():
                got = client.append(name, 1, 0, tokens=prompt)
                assert np.array_equal(got.rows, references[name].append(0, prompt))
                lengths[name] = got.length
            restored = 0
            for step in range(3):  # round robin: every append finds its session parked by the others
                for name in sessions:
                    token = 100 + step
                    got = client.append(name, 1, lengths[name], tokens=[token])
                    assert np.array_equal(got.rows, references[name].append(lengths[name], [token])), (name, step)
                    restored += got.restored
                    lengths[name] = got.length
                    checked(client)
            stats = checked(client)
            assert restored == 12 and stats.counters["misses"] == 0
            assert stats.counters["spills"] >= 12 and stats.counters["restores"] == 12
            # every park kept its context as the worker's spare, and every restore went into one: into the
            # context another session had just left (zeroed), and s2 and s3 were admitted into s0's and s1's
            assert stats.counters["restores_into_spare"] == 12
            assert stats.counters.get("restores_in_place", 0) == 0  # another session's spare is zeroed, then loaded
            assert stats.budget.spare_bytes == 0  # every spare a park left was taken by the restore it made room for
            tiers = sorted(row.tier for row in stats.sessions)
            assert tiers == ["hot", "hot", "ram", "ram"]
            assert stats.budget.spill_bytes > 0 and stats.budget.reserved_bytes == sum(row.charged_bytes for row in stats.sessions)
            for name in sessions:
                client.release(name, 1)
            stats = checked(client)
            assert stats.sessions == [] and stats.budget.spill_bytes == 0 and stats.budget.reserved_bytes == 0
    finally:
        for reference in references.values():
            reference.close()
        daemon.stop()


def test_a_released_or_superseded_sessions_context_serves_the_next_session_bit_identically(model_path, socket_dir, whole_model, prompt_ids):
    """A release, or a newer epoch, leaves the context as the worker's spare; the next sessions are admitted into
    it (zeroed first) and compute what a fresh context computes, bit for bit, never the ended history's."""
    daemon = _serve(model_path, socket_dir, "released-spare", "--max-sessions", "1")
    histories = [("a", 1, prompt_ids[0][:8]), ("b", 1, prompt_ids[1][:5]), ("b", 2, prompt_ids[0][:3]), ("a", 1, prompt_ids[0][:6])]
    try:
        with daemon.client() as client:
            for index, (name, epoch, prompt) in enumerate(histories):
                reference = Reference(whole_model)
                try:
                    got = client.append(name, epoch, 0, tokens=prompt)
                    assert got.admitted and np.array_equal(got.rows, reference.append(0, prompt)), (name, epoch)
                    step = client.append(name, epoch, len(prompt), tokens=[100 + index])
                    assert np.array_equal(step.rows, reference.append(len(prompt), [100 + index])), (name, epoch)
                finally:
                    reference.close()
                if (name, epoch) != ("b", 1):  # b at epoch 1 is ended by its epoch 2, not released
                    client.release(name, epoch)
                    budget = checked(client).budget
                    assert budget.reserved_bytes == 0 and budget.spare_bytes > 0, (name, epoch)
            counters = checked(client).counters
            assert (counters["spares_kept"], counters["admissions_into_spare"]) == (4, 3) and counters["misses"] == 0
    finally:
        daemon.stop()


def test_budget_pressure_parks_instead_of_refusing(model_path, socket_dir, whole_model, prompt_ids):
    probe = _serve(model_path, socket_dir, "charge-probe", "--max-sessions", "1")
    try:
        with probe.client() as client:
            client.append("probe", 1, 0, tokens=prompt_ids[0][:4])
            charge = client.stats().sessions[0].charged_bytes
    finally:
        probe.stop()
    daemon = _serve(model_path, socket_dir, "budget-two", "--max-sessions", "4", "--budget", str(int(charge * 2.5)))
    names = ["b0", "b1", "b2"]
    references = {name: Reference(whole_model) for name in names}
    try:
        with daemon.client() as client:
            for step in range(2):
                for index, name in enumerate(names):
                    tokens = prompt_ids[index % len(prompt_ids)][index : index + 5] if step == 0 else [9]
                    start = 0 if step == 0 else 5
                    got = client.append(name, 1, start, tokens=tokens)
                    assert np.array_equal(got.rows, references[name].append(start, tokens))
                    stats = checked(client)
                    assert stats.budget.reserved_bytes == sum(row.charged_bytes for row in stats.sessions if row.tier == "hot")
                    assert sum(row.tier == "hot" for row in stats.sessions) <= 2
            stats = checked(client)
            assert stats.counters["misses"] == 0 and stats.counters["restores"] == 3 and stats.counters["evictions"] == 0
    finally:
        for reference in references.values():
            reference.close()
        daemon.stop()


def test_a_full_spill_store_drops_the_oldest_blob_only(model_path, socket_dir, whole_model, prompt_ids):
    prompt = prompt_ids[0][:12]
    with whole_model.new_context(N_CTX) as probe:
        probe.append(0, tokens=np.asarray(prompt, np.int32))
        blob_bytes = len(probe.save_state())
    daemon = _serve(model_path, socket_dir, "full-store", "--max-sessions", "1", "--spill-budget", str(int(blob_bytes * 1.5)))
    reference = Reference(whole_model)
    try:
        with daemon.client() as client:
            client.append("oldest", 1, 0, tokens=prompt)
            client.append("middle", 1, 0, tokens=prompt)  # parks "oldest"
            reference.append(0, prompt)
            client.append("newest", 1, 0, tokens=prompt)  # parks "middle": the store holds one blob
            stats = checked(client)
            assert {row.session_id for row in stats.sessions} == {"middle", "newest"} and stats.counters["spill_drops"] == 1
            miss = refused(lambda: client.append("oldest", 1, 12, tokens=[5]))
            assert (miss.code, miss.reason) == ("cache_miss", "evicted")
            got = client.append("middle", 1, 12, tokens=[5])
            assert got.restored and np.array_equal(got.rows, reference.append(12, [5]))
            checked(client)
    finally:
        reference.close()
        daemon.stop()


def test_park_truncate_fork_fencing_and_release_of_parked_sessions(model_path, socket_dir, whole_model, prompt_ids):
    prompt = prompt_ids[1][:16]
    daemon = _serve(model_path, socket_dir, "park-fork", "--max-sessions", "2")
    source_reference, fork_reference = Reference(whole_model), Reference(whole_model)
    try:
        with daemon.client() as client:
            client.append("source", 3, 0, tokens=prompt)
            source_reference.append(0, prompt)
            fork_reference.append(0, prompt)
            assert client.park("source", 3).detail == "parked"
            stats = checked(client)
            assert [row.tier for row in stats.sessions] == ["ram"] and stats.budget.reserved_bytes == 0
            assert client.park("source", 3).detail == "already parked"
            # truncate a parked session: the restore cuts the saved state
            assert client.truncate("source", 3, 12) == 12
            source_reference.truncate(12)
            # fork the first 10 positions: a new parked session, independent of the source
            done = client.fork("source", 3, "fork", 1, 10)
            assert (done.length, done.detail) == (10, "forked")
            fork_reference.truncate(10)
            for step in range(3):
                got = client.append("fork", 1, 10 + step, tokens=[40 + step])
                assert np.array_equal(got.rows, fork_reference.append(10 + step, [40 + step]))
                assert got.restored == (step == 0)
            got = client.append("source", 3, 12, tokens=[7])  # the fork's appends changed nothing here
            assert got.restored and np.array_equal(got.rows, source_reference.append(12, [7]))
            # a fork of a hot source, past its length, and onto a live id are refused
            assert refused(lambda: client.fork("source", 3, "fork2", 1, 14)).code == "position_mismatch"
            assert refused(lambda: client.fork("source", 3, "fork", 1, 5)).code == "bad_request"
            # fencing of a parked session: a stale epoch is refused, a newer one drops the saved state
            client.park("fork", 1)
            assert refused(lambda: client.append("fork", 0, 13, tokens=[1])).code == "stale_epoch"
            got = client.append("fork", 2, 0, tokens=prompt[:4])
            assert got.admitted and got.length == 4
            assert refused(lambda: client.append("fork", 1, 13, tokens=[1])).code == "stale_epoch"
            client.park("fork", 2)
            spill_before = checked(client).budget.spill_bytes
            client.release("fork", 2)
            stats = checked(client)
            assert stats.budget.spill_bytes < spill_before and {row.session_id for row in stats.sessions} == {"source"}
            assert (refused(lambda: client.append("fork", 2, 4, tokens=[1])).reason) == "released"
    finally:
        source_reference.close()
        fork_reference.close()
        daemon.stop()


def test_parked_sessions_expire_after_the_ttl_and_park_after_parks_idle_ones(model_path, socket_dir, prompt_ids):
    daemon = _serve(model_path, socket_dir, "ttl-park", "--max-sessions", "1", "--park-after", "0.2", "--ttl", "3")
    try:
        with daemon.client() as client:
            client.append("idle", 1, 0, tokens=prompt_ids[0][:4])
            # parked (tier ram) and counted: the count follows the park by one await (its worker's context freed)
            stats = wait_until(lambda: (s := checked(client)).sessions and s.sessions[0].tier == "ram" and s.counters["parks"] and s,
                               "the idle session to be parked and counted")
            assert stats.budget.reserved_bytes == 0 and stats.counters["parks"] >= 1
            stats = wait_until(lambda: (s := checked(client)).counters["expirations"] and s, "the parked session to expire")
            assert stats.sessions == [] and stats.budget.spill_bytes == 0
            assert refused(lambda: client.append("idle", 1, 4, tokens=[1])).reason == "expired"
    finally:
        daemon.stop()


# Files a user keeps in the spill dir: names or contents that are not the store's own; start-up leaves them.
NOT_OURS = {
    "notes.partial": b"a user's notes",
    "notes.kvstate": MAGIC + b"a name the store never writes",
    "kvpool-00000009.kvstate": b"the store's name without its magic",
}


def _own_files(spill_dir):
    """Everything the store wrote or left (its lock file aside)."""
    return sorted(path for path in spill_dir.iterdir() if path.name not in NOT_OURS and path.name != spill.LOCK_NAME)


def test_the_disk_tier_checks_every_blob_and_removes_only_its_own_files(model_path, socket_dir, tmp_path, whole_model, prompt_ids):
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir(mode=0o700)
    (spill_dir / "kvpool-00000001.kvstate").write_bytes(OLD_MAGIC + b"left by an earlier run of the older format")
    (spill_dir / "kvpool-00000002.kvstate.partial").write_bytes(b"half a write of an earlier run")
    for name, data in NOT_OURS.items():
        (spill_dir / name).write_bytes(data)
    prompt = prompt_ids[0][:10]
    daemon = _serve(
        model_path, socket_dir, "disk", "--max-sessions", "1", "--spill-budget", "1000", "--spill-dir", str(spill_dir),
        "--spill-disk-budget", "64MiB",
    )
    reference = Reference(whole_model)
    try:
        assert _own_files(spill_dir) == []  # the earlier run's files are gone...
        assert {name: (spill_dir / name).read_bytes() for name in NOT_OURS} == NOT_OURS  # ...and nothing else
        with daemon.client() as client:
            for name in ("corrupt", "truncated", "fork-source", "intact", "hot"):
                client.append(name, 1, 0, tokens=prompt)
            reference.append(0, prompt)
            stats = checked(client)
            assert sorted(row.tier for row in stats.sessions) == ["disk", "disk", "disk", "disk", "hot"]
            assert stats.budget.spill_bytes == 0 and stats.budget.spill_disk_bytes > 0
            files = _own_files(spill_dir)
            assert len(files) == 4 and stat.S_IMODE(spill_dir.stat().st_mode) == 0o700
            assert all(path.read_bytes().startswith(MAGIC) for path in files)
            assert all(stat.S_IMODE(path.stat().st_mode) == 0o600 for path in files)
            corrupt, truncated, fork_source, _intact = files  # written in the order the sessions were parked
            for damaged in (corrupt, fork_source):
                data = bytearray(damaged.read_bytes())
                data[len(data) // 2] ^= 0xFF
                damaged.write_bytes(bytes(data))
            with open(truncated, "r+b") as stream:
                stream.truncate(os.path.getsize(truncated) // 2)
            for name in ("corrupt", "truncated"):
                miss = refused(lambda: client.append(name, 1, 10, tokens=[3]))
                assert (miss.code, miss.reason) == ("cache_miss", "restore_failed")
            # a fork reads its source's saved state: damaged, it is a failed restore like the others (counted once)
            miss = refused(lambda: client.fork("fork-source", 1, "child", 1, 5))
            assert (miss.code, miss.reason) == ("cache_miss", "restore_failed")
            got = client.append("intact", 1, 10, tokens=[3])
            assert got.restored and np.array_equal(got.rows, reference.append(10, [3]))
            stats = checked(client)
            assert stats.counters["restore_failures"] == 3
            assert {row.session_id: row.tier for row in stats.sessions} == {"intact": "hot", "hot": "disk"}
            (parked,) = _own_files(spill_dir)  # "hot", parked for "intact"'s restore; the others' files are gone
    finally:
        reference.close()
        daemon.stop(sig=signal.SIGINT)  # at once: SIGTERM drains (tests/daemon/test_drain.py)
    # An immediate stop loses only what was in memory: what was on disk stays, as after a crash (README, "the
    # drain"), beside the user's files and the directory's lock file.
    assert sorted(path.name for path in spill_dir.iterdir()) == sorted([*NOT_OURS, parked.name, spill.LOCK_NAME])


def test_a_full_disk_drops_only_the_pushed_session_and_the_daemon_keeps_serving(model_path, socket_dir, tmp_path, whole_model, prompt_ids):
    prompt = prompt_ids[0][:12]
    with whole_model.new_context(N_CTX) as probe:
        probe.append(0, tokens=np.asarray(prompt, np.int32))
        blob_bytes = len(probe.save_state())
    spill_dir = tmp_path / "full"
    with failing_writes(spill_dir) as break_writes:
        daemon = _serve(
            model_path, socket_dir, "full-disk", "--max-sessions", "1", "--spill-budget", str(int(blob_bytes * 1.5)),
            "--spill-dir", str(spill_dir), "--spill-disk-budget", "64MiB",
        )
        reference = Reference(whole_model)
        try:
            break_writes()
            with daemon.client() as client:
                client.append("pushed", 1, 0, tokens=prompt)
                client.append("kept", 1, 0, tokens=prompt)  # parks "pushed" in memory
                reference.append(0, prompt)
                got = client.append("newest", 1, 0, tokens=prompt)  # parks "kept": "pushed" must go to disk, and cannot
                assert got.admitted and got.length == len(prompt)
                stats = checked(client)
                assert {row.session_id: row.tier for row in stats.sessions} == {"kept": "ram", "newest": "hot"}
                assert stats.counters["spill_disk_failures"] >= 1 and stats.budget.spill_disk_bytes == 0
                assert own_files(spill_dir) == []  # no .partial (nor anything else of the store's) left
                miss = refused(lambda: client.append("pushed", 1, 12, tokens=[5]))
                assert (miss.code, miss.reason) == ("cache_miss", "evicted")
                got = client.append("kept", 1, 12, tokens=[5])  # the worker came back: "kept" is restored on it
                assert got.restored and np.array_equal(got.rows, reference.append(12, [5]))
                assert client.append("later", 1, 0, tokens=prompt).admitted  # and serves a new session too
                stats = checked(client)
                assert {row.session_id for row in stats.sessions} >= {"later"} and stats.counters["spill_disk_failures"] >= 2
                assert own_files(spill_dir) == []
        finally:
            reference.close()
            daemon.stop()
        serving = daemon.log().split("kvpool serve: shutting down")[0]  # (the way out is another item's)
        assert serving.count("spill disk tier") == 1, serving  # one line for the whole burst of failures
        assert "Traceback" not in serving and ("No space left on device" in serving or "Permission denied" in serving), serving


@pytest.mark.parametrize("untrusted", ["symlink", "group-writable"])
def test_an_untrusted_spill_dir_is_refused_at_start_and_its_files_kept(model_path, socket_dir, tmp_path, untrusted):
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    files = {"notes.partial": b"a user's notes", "kvpool-00000001.kvstate": MAGIC + b"the store's format"}
    for name, data in files.items():
        (target / name).write_bytes(data)
    spill_dir = target
    if untrusted == "symlink":
        spill_dir = tmp_path / "link"
        spill_dir.symlink_to(target)
    else:
        os.chmod(target, 0o770)
    log = _refused_start(model_path, socket_dir / f"refused-{untrusted}.sock", spill_dir, disk_budget="1MiB")
    errors = [line for line in log.splitlines() if "error" in line.lower()]
    expected = "is a symlink" if untrusted == "symlink" else "writable by group or others"
    assert len(errors) == 1 and errors[0].startswith("kvpool serve: error: --spill-dir") and expected in errors[0], log
    assert "starting" not in log, log  # refused before any worker started
    assert {name: (target / name).read_bytes() for name in files} == files and len(list(target.iterdir())) == len(files)


def _refused_start(model, socket_path, spill_dir, *, disk_budget="64MiB") -> str:
    """The log of a daemon on `spill_dir` that exited before it served: exit status 2, no traceback."""
    return refused_start(model, socket_path, "--threads", "1", "--n-ctx", str(N_CTX), "--max-sessions", "1", "--spill-dir", str(spill_dir), "--spill-disk-budget", disk_budget)


def test_a_spill_dir_has_one_owner_and_the_daemon_after_it_adopts(model_path, shards, socket_dir, tmp_path, whole_model, prompt_ids):
    """A second daemon on a live daemon's spill dir, of the same shard (it would adopt the live one's parked
    session, and remove its file on restore) or of another (it would remove every file as another shard's),
    is refused before any worker starts, with one line naming the owner's pid; the owner's files and
    sessions are untouched. Once the owner has stopped, a daemon on that directory adopts its sessions."""
    prompt = prompt_ids[0][:10]
    spill_dir = tmp_path / "owned"
    disk = ("--spill-dir", str(spill_dir), "--spill-disk-budget", "64MiB")
    owner = _serve(model_path, socket_dir, "owner", "--max-sessions", "2", "--spill-budget", "1", *disk)  # a parked state goes to disk
    reference = Reference(whole_model)
    successor = None
    try:
        with owner.client() as client:
            client.append("parked", 1, 0, tokens=prompt)
            reference.append(0, prompt)
            client.park("parked", 1)
            client.append("hot", 1, 0, tokens=prompt)
            files = {path.name: path.read_bytes() for path in spill_dir.iterdir() if path.name.startswith("kvpool-")}
            assert len(files) == 1
            for name, model in (("same-shard", model_path), ("other-shard", shards[0].path)):
                log = _refused_start(model, socket_dir / f"second-{name}.sock", spill_dir)
                errors = [line for line in log.splitlines() if "error" in line.lower()]
                line = f"kvpool serve: error: --spill-dir {spill_dir} is in use by kvpool serve pid {owner.process.pid} (one daemon per spill directory)"
                assert errors == [line] and "starting" not in log, (name, log)  # refused before any worker started
                assert {path.name: path.read_bytes() for path in spill_dir.iterdir() if path.name.startswith("kvpool-")} == files, name
            got = client.append("parked", 1, len(prompt), tokens=[5])
            assert got.restored and np.array_equal(got.rows, reference.append(len(prompt), [5]))
            assert client.append("hot", 1, len(prompt), tokens=[5]).length == len(prompt) + 1
            checked(client)
        assert owner.stop() == 0  # SIGTERM: a drain, both sessions parked on disk
        successor = _serve(model_path, socket_dir, "successor", "--max-sessions", "2", *disk)
        with successor.client() as client:
            adopted = {row.session_id: (row.length, row.tier) for row in checked(client).sessions}
            assert adopted == {"parked": (len(prompt) + 1, "disk"), "hot": (len(prompt) + 1, "disk")}
            got = client.append("parked", 1, len(prompt) + 1, tokens=[6])
            assert got.restored and np.array_equal(got.rows, reference.append(len(prompt) + 1, [6]))
    finally:
        reference.close()
        if successor is not None:
            successor.stop()
        owner.stop()


def test_a_park_whose_worker_dies_mid_save_answers_worker_lost(model_path, socket_dir, prompt_ids):
    prompt = prompt_ids[0][:8]
    daemon = _serve(model_path, socket_dir, "park-lost", "--max-sessions", "1")
    try:
        # no direct channel: the Park's first command to the worker is the save (a revoke would come first)
        with daemon.client(direct=False) as client, daemon.client() as observer:
            client.append("lost", 1, 0, tokens=prompt)
            worker_pid = observer.stats().sessions[0].worker_pid
            with stopped(worker_pid):  # the save cannot complete before the worker is killed
                thread, outcome = in_thread(lambda: client.park("lost", 1))
                wait_until(lambda: observer.stats().sessions[0].in_flight, "the park to be in flight")
                os.kill(worker_pid, signal.SIGKILL)
            error = joined(thread, outcome).get("error")
            assert isinstance(error, KvpoolError) and error.code == "worker_lost", outcome
            miss = refused(lambda: client.append("lost", 1, len(prompt), tokens=[5]))
            assert (miss.code, miss.reason) == ("cache_miss", "worker_lost")
            wait_until(lambda: [row.state for row in observer.stats().workers] == ["free"], "the lost worker's replacement")
            assert client.append("after", 1, 0, tokens=prompt).admitted
            checked(client)
    finally:
        daemon.stop()


def test_a_park_without_wait_is_answered_before_its_save_and_what_follows_waits_for_it(model_path, socket_dir, whole_model, prompt_ids):
    prompt = prompt_ids[0][:8]
    daemon = _serve(model_path, socket_dir, "park-behind", "--max-sessions", "2")
    reference = Reference(whole_model)
    try:
        with daemon.client(direct=False) as client, daemon.client() as observer:
            client.append("s", 1, 0, tokens=prompt)
            reference.append(0, prompt)
            worker_pid = observer.stats().sessions[0].worker_pid
            hits = observer.stats().counters.get("hits", 0)
            with stopped(worker_pid):  # the save cannot begin before the block ends
                assert client.park("s", 1, wait=False).detail == "parking"
                thread, outcome = in_thread(lambda: observer.append("s", 1, len(prompt), tokens=[5]))
                wait_until(lambda: client.stats().counters.get("hits", 0) == hits + 1, "the append behind the save")
                assert thread.is_alive()
            restored = joined(thread, outcome)["result"]
            assert restored.restored and np.array_equal(restored.rows, reference.append(len(prompt), [5]))
            # a worker killed while it saves behind the answer: the session ends with it, its next append says so
            client.append("k", 1, 0, tokens=prompt)
            worker_pid = next(row.worker_pid for row in observer.stats().sessions if row.session_id == "k")
            with stopped(worker_pid):
                assert client.park("k", 1, wait=False).detail == "parking"
                os.kill(worker_pid, signal.SIGKILL)
            miss = refused(lambda: client.append("k", 1, len(prompt), tokens=[5]))
            assert (miss.code, miss.reason) == ("cache_miss", "worker_lost")
            wait_until(lambda: sorted(row.state for row in observer.stats().workers) == ["bound", "free"], "the lost worker's replacement")
            checked(client)
    finally:
        reference.close()
        daemon.stop()


def test_a_restore_request_that_loads_the_state_binds_the_channel_and_continues_exactly(model_path, socket_dir, whole_model, prompt_ids):
    prompt = prompt_ids[0][:8]
    daemon = _serve(model_path, socket_dir, "restore-loaded", "--max-sessions", "1", "--min-residency", "0")
    reference = Reference(whole_model)
    try:
        with daemon.client() as client:
            client.append("s", 1, 0, tokens=prompt)
            reference.append(0, prompt)
            assert client.park("s", 1).detail == "parked"
            client.append("t", 1, 0, tokens=prompt[:3])  # takes the spare "s"'s park left (zeroed first: another session's)
            restored = client.restore("s", 1)  # parks "t" for the one place; its spare is zeroed, and "s"'s state loaded
            assert (restored.detail, restored.length) == ("restored", len(prompt)) and restored.channel
            stats = checked(client)
            assert {row.session_id: row.tier for row in stats.sessions} == {"s": "hot", "t": "ram"}
            assert stats.counters.get("restores_in_place", 0) == 0 and stats.counters["restore_requests"] == 1
            direct = stats.counters.get("direct_appends", 0)
            step = client.append("s", 1, len(prompt), tokens=[5])  # on the channel the Restore bound
            assert not step.restored and np.array_equal(step.rows, reference.append(len(prompt), [5]))
            assert checked(client).counters["direct_appends"] == direct + 1
    finally:
        reference.close()
        daemon.stop()
