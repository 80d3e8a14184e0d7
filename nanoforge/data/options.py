"""`nanoforge prepare`'s options beside --kind, --data, --tokenizer and --out: each field makes a flag
(cli.add_option_flags) and is a keyword of prepare_dataset. No tokenizers or torch here, for a quick `--help`."""
from __future__ import annotations

from dataclasses import dataclass

from nanoforge.core.config import option


@dataclass
class PrepareOptions:
    val_fraction: float = option(0.01, "[0, 1)", help="share held out for validation: of JSONL records, evenly "
                                 "spread; of each plain-text file, its last bytes from a line start (0: no validation "
                                 "split)")
    workers: int = option(0, "[0, inf)", help="tokenizer processes (0: all cores)")
    skip_invalid: bool = option(False, help="skip and count bad records instead of stopping")
    drop_empty_think: float = option(0.0, "[0, 1]", metavar="P", help="sft: render a seeded share P (0..1) of the "
                                     "records without the empty think blocks of their assistant turns, so the model "
                                     "learns both forms (MiniMind-3's recipe)")
    force: bool = option(False, help="replace --out if it exists")
    part: str | None = option(None, metavar="I/N", help="prepare only part I of N (1 <= I <= N): every N-th input "
                              "file, or of one JSONL file its I-th byte range; then `prepare merge` the parts")
    text_column: str = option("text", metavar="NAME", help="pretrain from Parquet or an HF datasets directory: the "
                              "column that holds the text")
