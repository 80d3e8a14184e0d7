"""Reading a JSON object file with an error a person can act on; durable and atomic writes: fsync a file or a
directory entry, put a finished file or directory in place in one rename; and the rules every command that writes
an output follows: the output apart from its inputs, a write that fails (a read-only file system, a full disk) one
line naming the output and the OS's reason. Torch-free, so data-preparation worker processes can import it without
paying for torch at start-up."""
import glob
import json
import os
import re
import shutil
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Iterable, Iterator

from nanoforge.core import safejson
from nanoforge.core.errors import NanoforgeError


def fsync_file(path: str | Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new file inside `path` survive a power cut (POSIX needs the directory synced too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: str | Path, what: str, hint: str = "") -> dict:
    """The JSON object in the file at `path`; else a NanoforgeError `PATH: not a valid WHAT (why)HINT`."""
    try:
        value = safejson.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NanoforgeError(f"{path}: not a valid {what} ({e}){hint}") from None
    if not isinstance(value, dict):
        raise NanoforgeError(f"{path}: not a valid {what} (not a JSON object){hint}")
    return value


def write_json(path: str | Path, obj) -> None:
    """`obj` as indented UTF-8 JSON with a final newline, flushed to disk."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """`data` (text as UTF-8) written under a temporary name (temp_for: processes never share one) and renamed
    over `path`, so a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    tmp = temp_for(path)
    try:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_out_dir(out_dir: Path, force: bool) -> None:
    """An output directory to be written: not a file, and empty unless `force` (it is replaced)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise NanoforgeError(f"{out_dir}: exists and is not a directory; choose another --out")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise NanoforgeError(f"{out_dir}: already exists and is not empty; pass --force to replace it")


def replace_dir(tmp: Path, out: Path) -> None:
    """Rename the finished directory `tmp` to `out`. An `out` already there is moved aside first (put back if
    the rename fails) and deleted only once the new one is in place: a crash leaves one of them, never neither."""
    if not out.exists():
        tmp.rename(out)
        return
    old = out.parent / f".tmp-old-{out.name}-{os.getpid()}"
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def check_out_apart(out: str | os.PathLike, inputs: Iterable, flag: str = "--out") -> None:
    """The one rule of every command that writes: its output is none of its inputs, holds none and is inside none
    (symlinks, hard links and `..` resolved), checked before anything is deleted or written. Inputs that do not
    exist (None, a preset's name) are passed over."""
    target = Path(out).resolve()
    for given in inputs:
        if given is None or not Path(given).exists():
            continue
        source = Path(given).resolve()
        same = target == source or target.exists() and os.path.samefile(target, source)  # a hard link too
        how = ("it is that input" if same else "it is inside it" if target.is_relative_to(source)
               else "it holds it" if source.is_relative_to(target) else None)
        if how:
            raise NanoforgeError(f"{flag} {out} would write over its input {given} ({how}); choose an {flag} "
                                 "apart from its inputs")


def os_error_in(e: BaseException, path: str | os.PathLike | None = None) -> OSError | None:
    """The OSError in `e`: itself, or the one a library put in its message (tokenizers and safetensors end theirs
    with `(os error N)`; shutil.copytree lists `[Errno N] ...` per file). None when it names none."""
    if isinstance(e, OSError) and e.errno is not None:
        return e
    found = re.search(r"(?:os error |\[Errno )(\d+)", str(e))
    return OSError(int(found[1]), os.strerror(int(found[1])), path) if found else e if isinstance(e, OSError) else None


def write_error(out: str | os.PathLike, e: BaseException) -> NanoforgeError:
    """The one message for an output that could not be written: `cannot write OUT: REASON`, REASON the OS's words
    (and the file it named, when not OUT itself); for an error that names none (torch.save's on a full disk), its
    text and the free space left."""
    os_error = os_error_in(e)
    reason = os_error.strerror or str(os_error) if os_error is not None else str(e)
    if os_error is not None and os_error.filename and str(os_error.filename) != str(out):
        reason += f" ({os_error.filename})"
    if os_error is None or os_error.errno is None:  # a short write, say, with no reason given: the disk's room
        with suppress(OSError):
            reason += f" ({shutil.disk_usage(Path(out).parent).free / 1e6:.1f} MB free on that file system)"
    return NanoforgeError(f"cannot write {out}: {reason}")


@contextmanager
def writing(out: str | os.PathLike, also: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Around the writing of `out`: an OSError (or one of `also`, a library's wrapping of one) leaves as
    write_error's one line. Whatever the block cleans up on its way out (its temporaries) it has cleaned by then."""
    try:
        yield
    except (OSError, *also) as e:
        raise write_error(out, e) from e


def temp_for(out: Path) -> Path:
    """Where this process builds the file or directory `out` before renaming it into place: `.NAME.tmp-PID`."""
    return out.parent / f".{out.name}.tmp-{os.getpid()}"


def remove_path(path: Path) -> None:
    """Remove a file or a directory tree, if there (a symlink itself, never what it points at)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale_temps(out: Path) -> None:
    """Remove the temp_for(out) files and directories that killed processes left. Only for a caller holding the
    lock that every writer of `out` holds while its temporary exists (dirlock.output_lock): no live one owns them."""
    for stale in out.parent.glob(f".{glob.escape(out.name)}.tmp-*"):
        if stale.name.rpartition("-")[2].isdigit():
            remove_path(stale)
