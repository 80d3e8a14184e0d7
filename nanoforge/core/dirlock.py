"""One process per directory: an OS-level lock that dies with the process that holds it.

A run directory is trained by one process at a time, a prepared-data directory written by one `prepare`. A
second process (a double Enter, a scheduler requeueing a job whose first copy still runs) stops at once, before
it changes anything, with an error naming the directory and the process that holds it.

The lock is `flock(2)` on a lock file, dropped by the kernel when the holder exits however it exits (SIGKILL
included): a crash never leaves a lock that blocks `--resume`. While held, the file says who holds it (pid,
host, command, start time); it is emptied on release, so a finished command leaves the directory as it found
it. Torch-free, for `prepare`. On network file systems flock is only as good as the server's lock support
(Linux NFSv4 emulates it with POSIX locks across clients); on a local disk it is exact."""
import fcntl
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from nanoforge.core.errors import NanoforgeError
from nanoforge.core.fsutil import remove_path, remove_stale_temps, replace_dir, temp_for


class DirectoryBusy(NanoforgeError):
    """Another live process holds the directory's lock."""


class DirLock:
    """A held lock; `release()` (or leaving the `with` block) gives it back, optionally removing the file."""

    def __init__(self, path: Path, fd: int, unlink_on_release: bool):
        self.path, self._fd, self._unlink = path, fd, unlink_on_release

    def release(self) -> None:
        if self._fd is None:
            return
        if self._unlink:  # unlink while still holding it, so no one can lock the old file after we let go
            self.path.unlink(missing_ok=True)
        else:  # an empty lock file is what a finished (or refused) command leaves: the directory is unchanged
            os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing the last descriptor releases the flock
        self._fd = None

    def __enter__(self) -> "DirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(lock_path: str | os.PathLike, what: str, unlink_on_release: bool = False) -> DirLock:
    """Lock `lock_path` (created if missing) without waiting; DirectoryBusy names the holder if it is taken.

    `what` says what the lock protects, for the message ("run directory runs/x"). With unlink_on_release the
    file is removed on release; a process that opened the old file just before that sees it was replaced and
    locks the new one instead (the inode check below), so two processes can never both hold "the" lock."""
    lock_path = Path(lock_path)
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(fd)
            os.close(fd)
            raise DirectoryBusy(f"{what} is in use by another process ({holder}); wait for it to finish or stop "
                                f"it, then run this again (a process that died holds no lock)") from None
        try:
            current = os.stat(lock_path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            break
        os.close(fd)  # the holder we waited on removed this file on release: lock the one there now
    _write_holder(fd)
    return DirLock(lock_path, fd, unlink_on_release)


@contextmanager
def output_lock(out_dir: Path, what: str) -> Iterator[DirLock]:
    """One writer at a time of a directory built beside itself and renamed into place (`prepare`, `prepare
    merge`): the lock `.NAME.lock` next to it (DirectoryBusy if held) and, once it is ours, the temporaries that
    writers killed mid-way left there removed (fsutil.remove_stale_temps): a live writer would hold this lock."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with acquire(out_dir.parent / f".{out_dir.name}.lock", what, unlink_on_release=True) as lock:
        remove_stale_temps(out_dir)
        yield lock


@contextmanager
def staged(out: Path, what: str = "being written") -> Iterator[Path]:
    """Where this process writes `out` (fsutil.temp_for) before the block renames it into place, under
    output_lock(out): one writer at a time, and what killed ones left removed. Removed if the block raises."""
    with output_lock(out, f"{out} ({what})"):
        tmp = temp_for(out)
        try:
            yield tmp
        except BaseException:
            remove_path(tmp)
            raise


@contextmanager
def staged_dir(out: Path, what: str = "being written") -> Iterator[Path]:
    """A directory built in staged(out), renamed onto `out` when the block ends (fsutil.replace_dir): `out` is
    the old one or the new one, never half of one."""
    with staged(out, what) as tmp:
        tmp.mkdir()
        yield tmp
        replace_dir(tmp, out)


def _write_holder(fd: int) -> None:
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]) if sys.argv else ""}
    data = (json.dumps(record) + "\n").encode("utf-8")
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _describe_holder(fd: int) -> str:
    """'pid 1234 on host h, since ..., running `nanoforge pretrain ...`', or what is known of it."""
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        text = f"pid {record['pid']} on host {record['host']}, since {record['started']}"
        return text + (f", running `{record['command']}`" if record.get("command") else "")
    except (ValueError, KeyError, TypeError, OSError):
        return "a process that has not yet written who it is"  # it locked the file a moment ago
