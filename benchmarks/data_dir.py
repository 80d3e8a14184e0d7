"""Where a benchmark finds the public data sets it measures on: the folder named by NANOFORGE_DATA, holding
minimind/ (MiniMind's JSONL files), minimind-tokenizer/, gsm8k/ (train.jsonl, test.jsonl) and tiny/. The
figures in docs/perf.md were measured on those files; see docs/data.md for where MiniMind's data comes from."""
import os
import sys
from pathlib import Path


def data_path(what: str, required: bool = True) -> Path | None:
    """NANOFORGE_DATA/what; with required=False, None when it is not there (the benchmark has a fallback)."""
    root = os.environ.get("NANOFORGE_DATA")
    path = Path(root) / what if root else None
    if path is not None and path.exists():
        return path
    if not required:
        return None
    sys.exit(f"this benchmark needs {what}: set NANOFORGE_DATA to the folder that holds it"
             + (f" ({path} is not there)" if path else ""))
