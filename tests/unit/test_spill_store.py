"""The spill store alone (no model, no daemon): its disk tier on a real full file system, and the checks of
its directory at start-up (whose files it removes, which directories it refuses)."""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import signal
import stat
import subprocess
import sys

import psutil
import pytest

from kvpool.daemon.books import spill
from kvpool.daemon.books.integrity import IntegrityError
from kvpool.daemon.books.spill import CorruptBlob, SpillStore, prepare_disk_dir
from kvpool.state.header import UNBOUND
from tests.support.daemons import in_thread, result, wait_until
from tests.support.disks import OLD_MAGIC, failing_writes, own_files, room_again

BLOB = bytes(range(256)) * 4  # 1 KiB


# ---- a full disk ---------------------------------------------------------------------------------


def test_a_failing_disk_write_drops_that_blob_alone_and_leaves_no_file(tmp_path, caplog):
    directory = tmp_path / "spill"
    with failing_writes(directory) as break_writes:
        store = SpillStore(len(BLOB) * 3 // 2, disk_dir=directory, disk_limit_bytes=len(BLOB) * 10)
        assert store.put("a", BLOB) == []
        break_writes()
        with caplog.at_level(logging.WARNING, logger="kvpool.serve"):
            assert store.put("b", BLOB[::-1]) == ["a"]  # "a" had to go to disk and could not
            assert store.put("c", BLOB) == ["b"]
        assert "a" not in store and "b" not in store and store.read("c") == BLOB
        store.check_integrity({"c"})
        assert (store.ram_bytes, store.disk_bytes, store.disk_failures) == (len(BLOB), 0, 2)
        assert own_files(directory) == []  # no .partial left
        warnings = [record for record in caplog.records if "spill disk tier" in record.getMessage()]
        assert len(warnings) == 1 and warnings[0].exc_info is None  # one line for the burst, no traceback
        assert "\n" not in warnings[0].getMessage()

        room_again(directory)
        assert store.put("d", BLOB[::-1]) == []  # "c" goes to disk now
        assert store.tier_of("c") == "disk" and store.read("c") == BLOB and store.disk_failures == 2
        store.check_integrity({"c", "d"})
        (written,) = own_files(directory)
        assert (directory / written).read_bytes() == BLOB

        caplog.clear()
        break_writes()
        with caplog.at_level(logging.WARNING, logger="kvpool.serve"):
            assert store.put("e", BLOB) == ["d"]
        assert len([record for record in caplog.records if "spill disk tier" in record.getMessage()]) == 1  # a new burst
        store.check_integrity({"c", "e"})
        store.close()
        store.check_integrity(set())
        assert own_files(directory) == []


def test_a_blob_bigger_than_memory_on_a_full_disk_is_dropped_itself(tmp_path):
    directory = tmp_path / "spill"
    with failing_writes(directory) as break_writes:
        store = SpillStore(len(BLOB) // 2, disk_dir=directory, disk_limit_bytes=len(BLOB) * 10)
        break_writes()
        assert store.put("big", BLOB) == ["big"]
        assert "big" not in store and store.disk_failures == 1 and own_files(directory) == []
        store.check_integrity(set())
        store.close()  # lets go of the directory (its lock file held open would keep the file system busy)


def test_a_disk_file_is_the_blob_private_and_read_back_checks_it(tmp_path):
    store = SpillStore(len(BLOB) // 2, disk_dir=tmp_path / "spill", disk_limit_bytes=len(BLOB) * 10)
    assert store.put("x", BLOB) == []
    path = store.path_of("x")
    assert path.name == "kvpool-00000001.kvstate" and path.read_bytes() == BLOB
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.write_bytes(b"X" + BLOB[1:])  # one byte changed behind the store's back
    with pytest.raises(CorruptBlob, match="fails its checksum"):
        store.read("x")
    store.close()


def test_the_format_and_the_refusal_are_the_stores():
    assert spill.OLD_MAGIC == OLD_MAGIC and spill.MAGIC == b"KVPSTAT1" and issubclass(spill.SpillDirRefused, ValueError)


def test_the_books_of_the_store_catch_a_lost_blob(tmp_path):
    """The check the daemon runs: a parked session whose blob is in no tier is an integrity error."""
    store = SpillStore(len(BLOB) * 2)
    store.put("a", BLOB)
    with pytest.raises(IntegrityError, match="stored blobs != the parked sessions"):
        store.check_integrity({"a", "lost"})


# ---- the spill directory -------------------------------------------------------------------------


def ours(directory: pathlib.Path, name: str) -> pathlib.Path:
    path = directory / name
    path.write_bytes(spill.MAGIC + b"an earlier run's state")
    return path


def test_start_up_removes_unfinished_writes_and_a_scan_only_the_stores_files_that_do_not_open(tmp_path):
    """prepare_disk_dir removes `.partial` files of the store's names; scan_disk_dir then removes the store's
    files that will never be adopted (an older format, a link under its name: the link, never its target)
    and leaves every file that is not the store's (another name, our name without any kvpool magic, a
    directory)."""
    directory = tmp_path / "spill"
    directory.mkdir(mode=0o700)
    outside = tmp_path / "outside.kvstate"
    outside.write_bytes(spill.MAGIC + b"someone's file")
    kept = {
        "notes.partial": b"a user's notes",
        "notes.kvstate": OLD_MAGIC + b"a name the store never writes",
        "kvpool-00000003.kvstate": b"our name, not our format",
        "00000001.kvstate": OLD_MAGIC + b"no prefix",
        "kvpool-1.kvstate.bak": OLD_MAGIC,
    }
    for name, data in kept.items():
        (directory / name).write_bytes(data)
    (directory / "kvpool-00000004.kvstate").symlink_to(outside)
    (directory / "kvpool-00000005.kvstate").mkdir()
    older = directory / "kvpool-00000001.kvstate"
    older.write_bytes(OLD_MAGIC + b"an earlier run's state")
    partial = directory / "kvpool-00000002.kvstate.partial"
    partial.write_bytes(b"half a write")

    prepare_disk_dir(directory)
    assert not partial.exists() and older.exists()
    found, rejected = spill.scan_disk_dir(directory, UNBOUND, 1 << 20)

    assert found == [] and not older.exists() and not (directory / "kvpool-00000004.kvstate").is_symlink()
    assert dict(rejected) == {"an older format": 1, "a link or not a regular file": 1, "left alone": 2}
    assert {name: (directory / name).read_bytes() for name in kept} == kept
    assert outside.read_bytes() == spill.MAGIC + b"someone's file"
    assert (directory / "kvpool-00000005.kvstate").is_dir()


def test_a_missing_spill_dir_is_created_private(tmp_path):
    directory = tmp_path / "a" / "spill"
    prepare_disk_dir(directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def refused(directory: pathlib.Path) -> str:
    with pytest.raises(ValueError) as raised:  # kvpool.daemon.books.spill.SpillDirRefused; `kvpool serve` prints it as one line
        prepare_disk_dir(directory)
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_a_symlinked_spill_dir_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    stale = ours(target, "kvpool-00000001.kvstate")
    (target / "notes.partial").write_bytes(b"notes")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert "symlink" in refused(link)
    assert stale.exists() and (target / "notes.partial").read_bytes() == b"notes"
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    assert "symlink" in refused(dangling) and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777], ids=["0770", "0707", "0777"])
def test_a_spill_dir_writable_by_group_or_others_is_refused(tmp_path, mode):
    directory = tmp_path / "spill"
    directory.mkdir()
    os.chmod(directory, mode)
    stale = ours(directory, "kvpool-00000001.kvstate")
    assert "writable by group or others" in refused(directory)
    assert stale.exists() and stat.S_IMODE(directory.stat().st_mode) == mode


def test_a_parent_writable_by_others_is_refused_unless_sticky(tmp_path):
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, 0o777)
    assert "writable by others without the sticky bit" in refused(parent / "spill")
    os.chmod(parent, 0o1777)
    prepare_disk_dir(parent / "spill")
    assert (parent / "spill").is_dir()


def test_a_spill_dir_or_parent_of_another_user_is_refused(tmp_path):
    if os.getuid() != 0:
        assert "not owned by this user" in refused(pathlib.Path("/"))  # root's; a user can make no other user's
        return
    other = 54321
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    os.chown(directory, other, other)
    assert "not owned by this user" in refused(directory)
    assert f"belongs to uid {other}" in refused(directory / "spill")
    assert not (directory / "spill").exists()  # nothing created under their directory


# ---- one owner at a time -------------------------------------------------------------------------

# A store held by another process: it prints its pid's "held" line, then on "stopping" says so in the lock
# file (as a daemon's teardown does) and waits; on end of input it lets go.
HOLDER = """
import pathlib, subprocess, sys
from kvpool.daemon.books.spill import SpillStore
store = SpillStore(1, disk_dir=pathlib.Path(sys.argv[1]), disk_limit_bytes=1 << 20)
child = subprocess.Popen(["sleep", "600"], close_fds=False) if "--with-child" in sys.argv else None
print("held", child.pid if child else 0, flush=True)
for line in sys.stdin:
    store.stopping()
    print("stopping", flush=True)
store.close(keep_files=True)
"""


def _holder(directory: pathlib.Path, *flags: str) -> tuple[subprocess.Popen, int]:
    """A process holding `directory`'s store; returns it and the pid of the child it started (0: none)."""
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), *flags], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline().split()
    assert line[:1] == ["held"], line
    return process, int(line[1])


def _in_use(directory: pathlib.Path, pid: int) -> str:
    return f"--spill-dir {directory} is in use by kvpool serve pid {pid} (one daemon per spill directory)"


def _contents(directory: pathlib.Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in directory.iterdir() if path.name.startswith("kvpool-")}


def test_a_second_store_on_a_held_directory_is_refused_and_touches_nothing(tmp_path):
    """The store owns its directory from before it removes or reads anything there until it closes: a
    second one (another daemon) is refused with one line naming the holder's pid, and every file stays,
    an unfinished write of the holder's and its states too. Once the holder closes, the next store takes
    the directory, and the lock file stays (it is not the store's to clean)."""
    directory = tmp_path / "spill"
    owner = SpillStore(len(BLOB) // 2, disk_dir=directory, disk_limit_bytes=len(BLOB) * 10)
    assert owner.put("x", BLOB) == []
    (directory / "kvpool-00000002.kvstate.partial").write_bytes(b"a write of the holder's in progress")
    (directory / "kvpool-00000003.kvstate").write_bytes(spill.MAGIC + b"a state the holder adopted")
    before = _contents(directory)
    for _attempt in range(2):
        with pytest.raises(ValueError) as raised:  # SpillDirRefused: `kvpool serve` prints it as one line
            SpillStore(len(BLOB), disk_dir=directory, disk_limit_bytes=len(BLOB) * 10)
        assert str(raised.value) == _in_use(directory, os.getpid())
        assert _contents(directory) == before
    assert owner.read("x") == BLOB
    owner.close(keep_files=True)
    successor = SpillStore(len(BLOB), disk_dir=directory, disk_limit_bytes=len(BLOB) * 10)
    assert not (directory / "kvpool-00000002.kvstate.partial").exists()  # its start-up work ran: it owns the directory
    found, rejected = successor.scan(UNBOUND)
    assert found == [] and sum(rejected.values()) == 2  # the two store files; the lock file is none of them
    lock = directory / spill.LOCK_NAME
    assert lock.is_file() and stat.S_IMODE(lock.stat().st_mode) == 0o600
    assert lock.read_text().split() == [str(os.getpid())]
    successor.close()
    assert lock.is_file()


def test_a_killed_holder_lets_go_at_once_and_its_children_never_held_the_lock(tmp_path):
    """The kernel ends a SIGKILLed holder's lock: the next store takes the directory without waiting, even
    while a process the holder started (as a daemon starts its workers) still runs."""
    directory = tmp_path / "spill"
    holder, child = _holder(directory, "--with-child")
    try:
        with pytest.raises(ValueError) as raised:
            SpillStore(1, disk_dir=directory, disk_limit_bytes=1 << 20)
        assert str(raised.value) == _in_use(directory, holder.pid)
        holder.kill()
        holder.wait()
        assert psutil.pid_exists(child)
        SpillStore(1, disk_dir=directory, disk_limit_bytes=1 << 20).close()
    finally:
        holder.kill()
        holder.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def test_a_holder_that_is_stopping_is_waited_for_with_a_progress_line(tmp_path, caplog):
    """A rolling restart: a daemon started while its predecessor tears down (its socket gone, its workers
    stopping) waits for the directory, saying so, and takes it once the predecessor lets go."""
    directory = tmp_path / "spill"
    holder, _ = _holder(directory)
    try:
        holder.stdin.write("stop\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "stopping"
        with caplog.at_level(logging.INFO, logger="kvpool.serve"):
            thread, outcome = in_thread(lambda: SpillStore(1, disk_dir=directory, disk_limit_bytes=1 << 20))
            waiting = f"--spill-dir {directory} is held by kvpool serve pid {holder.pid}, which is stopping: waiting for it to let go"
            wait_until(lambda: not thread.is_alive() or any(waiting in record.getMessage() for record in caplog.records), "the progress line")
            assert thread.is_alive(), outcome
            holder.stdin.close()  # it lets go
            store = result(thread, outcome)
        store.close()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("case", ["symlink", "open to others", "a file"])
def test_a_prefix_folder_in_the_spill_dir_that_is_not_private_is_refused_before_any_worker_starts(tmp_path, case):
    from kvpool.daemon.books.prefixes import SUBDIR
    from kvpool.daemon.config import ServeConfig

    directory = tmp_path / "spill"
    directory.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    folder = directory / SUBDIR
    if case == "symlink":
        folder.symlink_to(elsewhere)  # its files would be read from and written to another place
    elif case == "open to others":
        folder.mkdir(mode=0o700)
        folder.chmod(0o777)
    else:
        folder.write_bytes(b"not a folder")
    with pytest.raises(ValueError) as raised:
        ServeConfig(model="m", socket="/tmp/s", spill_dir=directory, spill_disk_budget_bytes=1 << 20)
    assert SUBDIR in str(raised.value) and "\n" not in str(raised.value).strip()
    assert sorted(path.name for path in directory.iterdir()) == [SUBDIR] and list(elsewhere.iterdir()) == []
    folder.unlink() if case != "open to others" else folder.chmod(0o700)
    assert ServeConfig(model="m", socket="/tmp/s", spill_dir=directory, spill_disk_budget_bytes=1 << 20).spill_dir == directory
