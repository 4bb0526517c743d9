"""Spill directories for tests: one whose writes can be made to fail (a full tmpfs), and the store's files in one."""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess

import pytest

OLD_MAGIC = b"KVPSPIL1"  # the disk format before states carried a header: such files are never adopted
FULL_FS_BYTES = 64 * 1024


@contextlib.contextmanager
def failing_writes(directory: pathlib.Path):
    """`directory` (0700) on a real file system; the yielded `break_writes()` makes every later write there
    fail with OSError: a 64 KiB tmpfs mounted there and filled to the last byte (ENOSPC; as root, the way
    this machine and CI run), else the directory made read-only (EACCES, for a user who may not mount)."""
    directory.mkdir(mode=0o700)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={FULL_FS_BYTES},mode=0700", "tmpfs", str(directory)], capture_output=True
    ).returncode == 0

    def break_writes() -> None:
        if mounted:
            with contextlib.suppress(OSError), open(directory / "filler", "wb") as filler:
                while True:
                    filler.write(b"\0" * 4096)
                    filler.flush()
        else:
            os.chmod(directory, 0o500)
        with pytest.raises(OSError):  # the premise, checked: a real write there fails
            (directory / "probe").write_bytes(b"x" * 8192)
        with contextlib.suppress(OSError):
            (directory / "probe").unlink()

    try:
        yield break_writes
    finally:
        if mounted:
            subprocess.run(["umount", str(directory)], check=True)
        else:
            os.chmod(directory, 0o700)


def room_again(directory: pathlib.Path) -> None:
    """Undo break_writes (the filler removed, or write permission back)."""
    with contextlib.suppress(FileNotFoundError):
        (directory / "filler").unlink()
    os.chmod(directory, 0o700)


def own_files(directory: pathlib.Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir() if path.name.startswith("kvpool-"))
