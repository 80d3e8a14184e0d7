"""Reading a JSON object file with an error a person can act on; durable and atomic writes: fsync a file or a
directory entry, put a finished file or directory in place in one rename. Torch-free, so data-preparation
worker processes can import it without paying for torch at start-up."""
import json
import os
import shutil
from pathlib import Path

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


def write_text_atomic(path: str | Path, text: str) -> None:
    """`text` written under a temporary name (with the pid: processes never share one) and renamed over `path`,
    so a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
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
