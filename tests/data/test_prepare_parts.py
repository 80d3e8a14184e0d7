"""`prepare --part I/N` and `prepare merge`: N parts prepared apart and merged give the tokens of one prepare
(every record in the same split), the merged directory references the parts' shards instead of copying them,
and merging checks that the parts belong together and are whole: a refused merge writes nothing and changes no
part. Real processes, as N jobs would run them."""
import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from nanoforge.data.parts import merge_prepared
from nanoforge.data.prepare import prepare_dataset
from nanoforge.data.shards import TokenShards
from nanoforge.core.errors import NanoforgeError

ROOT = Path(__file__).resolve().parents[2]


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
    with pytest.raises(NanoforgeError, match=r"pre: part 1/1 of its input is given twice \(as .*pre too\)"):
        merge_prepared([tmp_path / "pre", tmp_path / "pre"], tmp_path / "m3")
    with pytest.raises(NanoforgeError, match=r"--part '3/2': expected I/N"):
        prepare_dataset("pretrain", [corpus[0]], tiny_tokenizer, tmp_path / "p", part="3/2", **kw)
    assert not (tmp_path / "m1").exists() and not (tmp_path / "m2").exists()


@pytest.fixture(scope="module")
def parts(corpus, tiny_tokenizer, tmp_path_factory):
    """Parts 1-2 of 2 (p1, p2) and 1-3 of 3 (q1..q3) of one file, its whole prepare, and damaged copies."""
    t = tmp_path_factory.mktemp("merge_refusals")
    kw = dict(val_fraction=0.1, workers=1, log=lambda *a: None)
    for name, part in [("p1", "1/2"), ("p2", "2/2"), ("q1", "1/3"), ("q2", "2/3"), ("q3", "3/3"), ("whole", None)]:
        prepare_dataset("pretrain", [corpus[0]], tiny_tokenizer, t / name, part=part, **kw)
    for name in ("p2gone", "p2cut", "p2old", "p1again"):
        shutil.copytree(t / ("p1" if name == "p1again" else "p2"), t / name)
    (t / "p2gone" / "train_00000.bin").unlink()
    with open(t / "p2cut" / "train_00000.bin", "r+b") as f:
        f.truncate(100)
    manifest = json.loads((t / "p2old" / "manifest.json").read_text())
    manifest["part"] = "2/2"  # as an older nanoforge wrote it: no identity of the input
    (t / "p2old" / "manifest.json").write_text(json.dumps(manifest))
    (t / "p2link").symlink_to(t / "p2", target_is_directory=True)
    return t


MERGE_REFUSALS = [  # (id, `prepare merge` arguments, words of the message)
    ("shard-deleted", ["{t}/p1", "{t}/p2gone", "--out", "{t}/out"],
     ["{t}/p2gone/train_00000.bin: missing"]),
    ("shard-truncated", ["{t}/p1", "{t}/p2cut", "--out", "{t}/out"],
     ["{t}/p2cut/train_00000.bin: 100 bytes but the manifest says"]),
    ("part-twice", ["{t}/p1", "{t}/p1again", "{t}/p2", "--out", "{t}/out"],
     ["{t}/p1again: part 1/2 of its input is given twice (as {t}/p1 too); its tokens would be counted twice"]),
    ("incomplete", ["{t}/q1", "{t}/q2", "--out", "{t}/out"],
     ["{t}/q1, {t}/q2: part(s) 3/3 of the same input are not given", "--allow-incomplete"]),
    ("other-splittings", ["{t}/p1", "{t}/q2", "{t}/q3", "--out", "{t}/out"],
     ["{t}/q2: part 2/3, but {t}/p1 is part 1/2 of the same input: their records overlap"]),
    ("whole-and-part", ["{t}/whole", "{t}/p2", "--out", "{t}/out"],
     ["{t}/p2: part 2/2, but {t}/whole is part 1/1 of the same input"]),
    ("older-part", ["{t}/p1", "{t}/p2old", "--out", "{t}/out"],
     ["{t}/p2old: its manifest does not say which part of which input it holds (prepared by an older nanoforge"]),
    ("out-is-an-input", ["{t}/p1", "{t}/p2", "--out", "{t}/p1", "--force"],
     ["--out {t}/p1 would write over its input {t}/p1"]),
    ("out-is-an-input-spelled-otherwise", ["{t}/p1", "{t}/p2", "--out", "{t}/q1/../p2", "--force"],
     ["--out {t}/q1/../p2 would write over its input {t}/p2"]),
    ("out-is-a-link-to-an-input", ["{t}/p1", "{t}/p2", "--out", "{t}/p2link", "--force"],
     ["--out {t}/p2link would write over its input {t}/p2"]),
    ("out-inside-an-input", ["{t}/p1", "{t}/p2", "--out", "{t}/p1/merged"],
     ["--out {t}/p1/merged would write over its input {t}/p1"]),
    ("out-holds-the-inputs", ["{t}/p1", "{t}/p2", "--out", "{t}", "--force"],
     ["--out {t} would write over its input {t}/p1"]),
]


@pytest.fixture(scope="module")
def merge_outcomes(parts):
    """Each refusal run by the real CLI (a few at a time), and the whole tree before and after all of them."""
    from conftest import tree_state
    before = tree_state(parts)
    with ThreadPoolExecutor(max_workers=3) as pool:
        runs = {cid: pool.submit(nf, "prepare", "merge", *(a.format(t=parts) for a in args))
                for cid, args, _ in MERGE_REFUSALS}
        results = {cid: run.result() for cid, run in runs.items()}
    return results, before, tree_state(parts)


@pytest.mark.slow
@pytest.mark.parametrize("case_id,args,words", MERGE_REFUSALS, ids=[c[0] for c in MERGE_REFUSALS])
def test_merge_refuses_parts_it_cannot_trust_and_writes_nothing(merge_outcomes, parts, case_id, args, words):
    results, before, after = merge_outcomes
    r = results[case_id]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for w in words:
        assert w.format(t=parts) in r.stderr, r.stderr
    assert after == before, f"written or changed: {sorted(set(after.items()) ^ set(before.items()))}"


@pytest.mark.slow
def test_allow_incomplete_merges_some_parts_only(parts, tmp_path):
    res = nf("prepare", "merge", parts / "q1", parts / "q2", "--out", tmp_path / "some", "--allow-incomplete")
    assert res.returncode == 0, res.stderr
    some = TokenShards(tmp_path / "some", "train").num_tokens
    assert some == sum(TokenShards(parts / q, "train").num_tokens for q in ("q1", "q2"))
    from nanoforge.cli import build_parser
    commands = next(a.choices for a in build_parser()._actions if isinstance(a.choices, dict))
    merge = next(a.choices for a in commands["prepare"]._actions if isinstance(a.choices, dict))["merge"]
    assert "--allow-incomplete" in merge.format_help()  # `prepare merge` is a subcommand
    # a complete merge is the whole of its input: it merges on, and counts as the whole prepare does
    assert nf("prepare", "merge", parts / "q1", parts / "q2", parts / "q3", "--out", tmp_path / "all").returncode == 0
    again = nf("prepare", "merge", tmp_path / "all", parts / "whole", "--out", tmp_path / "twice")
    assert again.returncode == 1 and f"{parts / 'whole'}: part 1/1 of its input is given twice" in again.stderr
