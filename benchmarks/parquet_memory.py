"""Memory while reading a large Parquet file the way `prepare` does (data/columnar.py's row_chunks: row group by
row group, 1024 rows at a time), against the file's size.

    .venv/bin/python benchmarks/parquet_memory.py             # a 1 GB file (uncompressed, 64 MB row groups)
    .venv/bin/python benchmarks/parquet_memory.py --mb 200

The file is written row group by row group from the shared pretraining text (repeated, each row numbered), so
writing it never holds it either; then a fresh process reads every row through row_chunks and reports its peak
resident memory (VmHWM; ru_maxrss would carry the parent's peak over exec) next to a baseline process that
only imports pyarrow and nanoforge. The file lives in a temporary directory deleted at the end. Figures go to
docs/perf.md with this command line.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("NANOFORGE_DATA", "data")) / "minimind" / "pretrain_en_tinystories.jsonl"  # see data_dir.py

READER = """
import re, sys, time
from pathlib import Path
from nanoforge.data.columnar import row_chunks
start, rows, chars = time.perf_counter(), 0, 0
if sys.argv[1] != "-":
    for _, chunk in row_chunks(Path(sys.argv[1]), "pretrain"):
        rows += len(chunk)
        chars += sum(len(r["text"]) for r in chunk)
hwm = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))  # this process's own peak
print(rows, chars, time.perf_counter() - start, hwm // 1024)
"""


def write_file(path: Path, megabytes: int) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq
    texts = [json.loads(line)["text"] for line in SHARED.read_text(encoding="utf-8").splitlines()]
    group_bytes, written, row = 64 << 20, 0, 0
    schema = pa.schema([("text", pa.string())])
    with pq.ParquetWriter(path, schema, compression="NONE") as writer:
        while written < megabytes << 20:
            batch, size = [], 0
            while size < group_bytes:
                text = f"{row}: {texts[row % len(texts)]}"
                batch.append(text)
                size += len(text.encode("utf-8"))
                row += 1
            writer.write_table(pa.table({"text": batch}, schema=schema), row_group_size=len(batch))
            written += size
    return row


def read(path: str) -> list[str]:
    reader = READER.replace("if sys.argv", "import pyarrow.parquet\nif sys.argv")  # the baseline loads pyarrow too
    out = subprocess.run([sys.executable, "-c", reader, path], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(REPO)})
    return out.stdout.split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=1000, help="size of the Parquet file to write, MB")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nanoforge-parquet-") as tmp:
        path = Path(tmp) / "big.parquet"
        start = time.perf_counter()
        rows = write_file(path, args.mb)
        print(f"wrote {path.stat().st_size / 1e6:,.0f} MB, {rows:,} rows in {time.perf_counter() - start:.0f} s")
        base = read("-")
        got = read(str(path))
        print(f"read {int(got[0]):,} rows, {int(got[1]) / 1e6:,.0f} M chars in {float(got[2]):.1f} s; "
              f"peak RSS {int(got[3])} MB (baseline process: {int(base[3])} MB)")


if __name__ == "__main__":
    main()
