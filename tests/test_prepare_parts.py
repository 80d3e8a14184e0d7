"""`prepare --part I/N` and `prepare merge`: N parts prepared apart and merged give the tokens of one prepare
(every record in the same split), the merged directory references the parts' shards instead of copying them,
and merging checks that the parts belong together. Real processes, as N jobs would run them."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nanoforge.data.parts import merge_prepared
from nanoforge.data.prepare import prepare_dataset
from nanoforge.data.shards import TokenShards
from nanoforge.errors import NanoforgeError

ROOT = Path(__file__).resolve().parents[1]


def nf(*args):
    return subprocess.run([sys.executable, "-m", "nanoforge", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def stream(prepared, split):
    shards = TokenShards(prepared, split)
    mask = shards.read_mask(0, shards.num_tokens) if shards.has_mask else None
    return shards.read(0, shards.num_tokens), shards.doc_offsets(), mask


def docs(prepared, split):
    shards = TokenShards(prepared, split)
    return sorted(shards.doc(i)[0].tobytes() for i in range(shards.num_docs))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from conftest import tiny_corpus
    return tiny_corpus(tmp_path_factory.mktemp("parts_corpus"))


def test_two_byte_range_parts_merged_equal_one_prepare(corpus, tiny_tokenizer_dir, tmp_path):
    sft = corpus[1]
    common = ["--kind", "sft", "--data", sft, "--tokenizer", tiny_tokenizer_dir, "--val-fraction", 0.1,
              "--workers", 1]
    for i in (1, 2):
        res = nf("prepare", *common, "--part", f"{i}/2", "--out", tmp_path / f"part{i}")
        assert res.returncode == 0, res.stderr
    res = nf("prepare", "merge", tmp_path / "part1", tmp_path / "part2", "--out", tmp_path / "merged")
    assert res.returncode == 0, res.stderr
    assert nf("prepare", *common, "--out", tmp_path / "whole").returncode == 0
    for split in ("train", "val"):
        for a, b in zip(stream(tmp_path / "merged", split), stream(tmp_path / "whole", split)):
            assert np.array_equal(a, b), split
    manifest = json.loads((tmp_path / "merged" / "manifest.json").read_text())
    assert manifest["parts"] == ["../part1", "../part2"]
    assert not list((tmp_path / "merged").glob("*.bin")), "no token data copied"
    ranges = [s["byte_range"] for s in manifest["sources"]]
    assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == sft.stat().st_size


def test_every_nth_file_parts_hold_the_same_records_in_the_same_splits(corpus, tiny_tokenizer, tmp_path):
    lines = corpus[0].read_text(encoding="utf-8").splitlines(keepends=True)
    files = []
    for k in range(5):  # five files of unequal length; parts take files 1,3,5 and 2,4
        files.append(tmp_path / f"in{k}.jsonl")
        files[-1].write_text("".join(lines[k * 30:(k + 1) * 30 + 7 * k]), encoding="utf-8")
    kw = dict(val_fraction=0.1, workers=1, log=lambda *a: None)
    for i in (1, 2):
        prepare_dataset("pretrain", files, tiny_tokenizer, tmp_path / f"part{i}", part=f"{i}/2", **kw)
    merge_prepared([tmp_path / "part1", tmp_path / "part2"], tmp_path / "merged", log=lambda *a: None)
    prepare_dataset("pretrain", files, tiny_tokenizer, tmp_path / "whole", **kw)
    for split in ("train", "val"):
        assert docs(tmp_path / "merged", split) == docs(tmp_path / "whole", split), split
    assert TokenShards(tmp_path / "merged", "val").num_docs > 0
    # a training command given the parts merges them into RUN/data (a manifest, no tokens) and trains on them
    run = nf("pretrain", "--preset", "tiny", "--n-layers", 1, "--data", tmp_path / "part1", tmp_path / "part2",
             "--out", tmp_path / "run", "--max-steps", 2, "--seq-len", 32, "--tensorboard", "false",
             "--eval-every", 2, "--quiet")
    assert run.returncode == 0, run.stderr
    assert '"val_loss"' in (tmp_path / "run" / "metrics.jsonl").read_text()
    in_run = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())
    merged = json.loads((tmp_path / "merged" / "manifest.json").read_text())
    assert {k: v["tokens"] for k, v in in_run["splits"].items()} == {k: v["tokens"] for k, v in merged["splits"].items()}
    assert in_run["parts"] == ["../../part1", "../../part2"]
    assert not list((tmp_path / "run" / "data").glob("*.bin"))


def test_merge_refuses_parts_that_do_not_belong_together(corpus, tiny_tokenizer, tmp_path):
    kw = dict(workers=1, log=lambda *a: None)
    prepare_dataset("pretrain", [corpus[0]], tiny_tokenizer, tmp_path / "pre", **kw)
    prepare_dataset("sft", [corpus[1]], tiny_tokenizer, tmp_path / "sft", **kw)
    prepare_dataset("pretrain", [corpus[0]], tiny_tokenizer, tmp_path / "pre5", val_fraction=0.5, **kw)
    with pytest.raises(NanoforgeError, match=r"pre does not match .*pre5|sft does not match.*kind 'pretrain' vs 'sft'"):
        merge_prepared([tmp_path / "pre", tmp_path / "sft"], tmp_path / "m1")
    with pytest.raises(NanoforgeError, match=r"val_fraction 0.01 vs 0.5"):
        merge_prepared([tmp_path / "pre", tmp_path / "pre5"], tmp_path / "m2")
    with pytest.raises(NanoforgeError, match="given twice"):
        merge_prepared([tmp_path / "pre", tmp_path / "pre"], tmp_path / "m3")
    with pytest.raises(NanoforgeError, match=r"--part '3/2': expected I/N"):
        prepare_dataset("pretrain", [corpus[0]], tiny_tokenizer, tmp_path / "p", part="3/2", **kw)
    assert not (tmp_path / "m1").exists() and not (tmp_path / "m2").exists()
