"""Durable writes: fsync a file or a directory entry. Torch-free, so data-preparation worker processes can
import it without paying for torch at start-up."""
from __future__ import annotations

import os
from pathlib import Path


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
