"""Checksums of the files nanoforge writes for later reading (a checkpoint's, an export's): one `sha256sum`-style
listing beside them, written with them and verified where each file is read again.

    DIR/checksums.sha256     "<sha256>  <name>" per file of DIR (an HF export, a checkpoint directory)
    FILE.sha256              the same for one file that is an output of its own (a MiniMind .pth export)

`sha256sum -c checksums.sha256` checks them by hand. A file the listing does not name (or a directory without
one: written by an older nanoforge) is read without a check. Torch-free, like fsutil."""
import hashlib
import os
import re
from pathlib import Path

from nanoforge.core.errors import NanoforgeError
from nanoforge.core.fsutil import fsync_file

LISTING = "checksums.sha256"
_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")


class DamagedFile(NanoforgeError):
    """A file nanoforge wrote earlier reads back other than it was written (checksum, truncation, non-finite
    values): the message names the file; a resumed run offers its previous intact checkpoint."""


def sha256_of(path: str | os.PathLike) -> str:
    """The file's sha256 as hex (read in 1 MiB pieces); OSError as raised."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_checksums(listing: str | os.PathLike, files: list[Path]) -> None:
    """Write (and fsync) `listing` naming each of `files` (all beside it) with its sha256."""
    listing = Path(listing)
    lines = [f"{sha256_of(f)}  {Path(f).name}\n" for f in sorted(files, key=lambda p: Path(p).name)]
    listing.write_text("".join(lines), encoding="utf-8")
    fsync_file(listing)


def write_dir_checksums(directory: str | os.PathLike) -> None:
    """checksums.sha256 over every plain file directly in `directory` (sub-directories, e.g. a tokenizer/ of
    its own, are left out)."""
    directory = Path(directory)
    write_checksums(directory / LISTING, [p for p in directory.iterdir() if p.is_file() and p.name != LISTING])


def replace_with_checksum(tmp: Path, out: Path) -> None:
    """Rename the finished file `tmp` to `out` with `out`.sha256 beside it. An old listing goes first, so a crash
    in between leaves `out` unchecked, never checked against another file's sum."""
    listing = out.with_name(out.name + ".sha256")
    staged = tmp.with_name(tmp.name + ".sha256")
    try:
        staged.write_text(f"{sha256_of(tmp)}  {out.name}\n", encoding="utf-8")
        fsync_file(staged)
        listing.unlink(missing_ok=True)
        os.replace(tmp, out)
        os.replace(staged, listing)
    finally:
        staged.unlink(missing_ok=True)


def expected_sha256(path: Path) -> tuple[str, Path] | None:
    """(the recorded sha256 of `path`, the listing that records it), or None when nothing records it."""
    for listing in (path.parent / LISTING, path.with_name(path.name + ".sha256")):
        if not listing.is_file():
            continue
        try:
            lines = listing.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise DamagedFile(f"{listing}: cannot read the checksums: {e}") from None
        for number, line in enumerate(lines, 1):
            m = _LINE.match(line)
            if m is None:
                raise DamagedFile(f"{listing}:{number}: not a checksum line (\"<sha256>  <file name>\"); the "
                                  "listing is damaged")
            if m.group(2) == path.name:
                return m.group(1), listing
    return None


def verify_file(path: str | os.PathLike) -> None:
    """Refuse `path` (DamagedFile, naming it) when its sha256 is not the one recorded when it was written.
    A file without a recorded checksum passes: nothing to compare with."""
    path = Path(path)
    recorded = expected_sha256(path)
    if recorded is None:
        return
    want, listing = recorded
    try:
        have = sha256_of(path)
    except OSError as e:
        raise DamagedFile(f"{path}: cannot read it: {e.strerror or e}") from None
    if have != want:
        raise DamagedFile(f"{path}: the file is corrupted or was replaced since it was written: its sha256 is "
                          f"{have[:12]}..., but {listing.name} recorded {want[:12]}... (a file replaced on purpose: "
                          f"delete {listing})")
