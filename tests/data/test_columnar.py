"""Parquet files and HF datasets directories as input: the same prepared tokens as the JSONL they were made
from (pretrain, SFT, DPO), errors that name the file and row, --text-column, and a training command reading
Parquet directly. Real processes where a user would type the command."""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from nanoforge.data.jsonl import DataError
from nanoforge.data.prepare import prepare_dataset

pa = pytest.importorskip("pyarrow", reason="Parquet input needs pyarrow (the `parquet` extra)")
import pyarrow.parquet as pq  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def nf(*args):
    return subprocess.run([sys.executable, "-m", "nanoforge", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def jsonl_records(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def write_parquet(records, path, row_group_size=7):
    """Several row groups, so reading them one by one is exercised."""
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


def write_saved_dataset(records, directory, batch_rows=16):
    """What `datasets.Dataset.save_to_disk` writes: Arrow IPC stream files listed in state.json."""
    directory.mkdir()
    table = pa.Table.from_pylist(records)
    with pa.OSFile(str(directory / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=batch_rows):
                writer.write_batch(batch)
    (directory / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
                                                      "_split": "train"}))
    (directory / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return directory


def shard_bytes(prepared):
    """Every token, offset and mask byte of a prepared directory, by file name."""
    return {p.name: p.read_bytes() for p in sorted(Path(prepared).iterdir()) if p.suffix in (".bin", ".idx", ".mask")}


def prepare(kind, files, tokenizer, out, **kw):
    return prepare_dataset(kind, files, tokenizer, out, val_fraction=0.1, workers=1, log=lambda *a: None, **kw)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from conftest import tiny_corpus
    work = tmp_path_factory.mktemp("columnar_corpus")
    pre, sft = tiny_corpus(work)
    dpo = pre.parent / "dpo_tiny.jsonl"
    return {"pretrain": pre, "sft": sft, "dpo": dpo if dpo.is_file() else None}


@pytest.mark.parametrize("kind", ["pretrain", "sft", "dpo"])
def test_parquet_and_jsonl_give_the_same_tokens(kind, corpus, tiny_tokenizer, tmp_path):
    if corpus[kind] is None:
        pytest.skip("no DPO file without the shared data")
    records = jsonl_records(corpus[kind])
    parquet = write_parquet(records, tmp_path / f"{kind}.parquet")
    a = prepare(kind, [corpus[kind]], tiny_tokenizer, tmp_path / "from_jsonl")
    b = prepare(kind, [parquet], tiny_tokenizer, tmp_path / "from_parquet")
    assert shard_bytes(tmp_path / "from_parquet") == shard_bytes(tmp_path / "from_jsonl")
    assert a["splits"] == b["splits"]
    assert b["sources"][0]["records"] == len(records)


def test_a_saved_dataset_directory_reads_like_its_jsonl(corpus, tiny_tokenizer, tmp_path):
    records = jsonl_records(corpus["sft"])
    saved = write_saved_dataset(records, tmp_path / "saved")
    prepare("sft", [corpus["sft"]], tiny_tokenizer, tmp_path / "from_jsonl")
    prepare("sft", [saved], tiny_tokenizer, tmp_path / "from_arrow")
    assert shard_bytes(tmp_path / "from_arrow") == shard_bytes(tmp_path / "from_jsonl")


def test_a_real_save_to_disk_directory(corpus, tiny_tokenizer, tmp_path):
    datasets = pytest.importorskip("datasets", reason="`datasets` is not installed (only this fixture needs it)")
    datasets.Dataset.from_list(jsonl_records(corpus["pretrain"])).save_to_disk(str(tmp_path / "saved"))
    prepare("pretrain", [corpus["pretrain"]], tiny_tokenizer, tmp_path / "from_jsonl")
    prepare("pretrain", [tmp_path / "saved"], tiny_tokenizer, tmp_path / "from_arrow")
    assert shard_bytes(tmp_path / "from_arrow") == shard_bytes(tmp_path / "from_jsonl")


def write_saved_dataset_dict(splits: dict[str, list[dict]], directory: Path) -> Path:
    """What `datasets.DatasetDict.save_to_disk` writes: dataset_dict.json and a saved dataset per split."""
    directory.mkdir()
    for name, records in splits.items():
        write_saved_dataset(records, directory / name)
    (directory / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    return directory


def test_a_real_dataset_dict_directory_is_read_by_split(corpus, tiny_tokenizer_dir, tmp_path):
    """`load_dataset(...).save_to_disk(DIR)` gives a DatasetDict directory: `prepare --data DIR` reads its train
    split, --split another; a split it has not is named with those it has (it said "pass the .jsonl files")."""
    datasets = pytest.importorskip("datasets", reason="`datasets` is not installed (only this fixture needs it)")
    records = jsonl_records(corpus["pretrain"])
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records),
                          "test": datasets.Dataset.from_list(records[:5])}).save_to_disk(str(tmp_path / "dd"))
    args = ["prepare", "--kind", "pretrain", "--tokenizer", tiny_tokenizer_dir, "--workers", 1, "--data"]
    assert nf(*args, corpus["pretrain"], "--out", tmp_path / "from_jsonl").returncode == 0
    res = nf(*args, tmp_path / "dd", "--out", tmp_path / "train")
    assert res.returncode == 0, res.stderr
    assert shard_bytes(tmp_path / "train") == shard_bytes(tmp_path / "from_jsonl")
    assert nf(*args, tmp_path / "dd", "--split", "test", "--out", tmp_path / "test").returncode == 0
    [source] = json.loads((tmp_path / "test" / "manifest.json").read_text())["sources"]
    assert source["records"] == 5 and Path(source["path"]) == tmp_path / "dd" / "test"
    res = nf(*args, tmp_path / "dd", "--split", "validation", "--out", tmp_path / "none")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert (f"error: {tmp_path / 'dd'}: a datasets DatasetDict with the splits train, test, and no 'validation': "
            "choose one with --split NAME") in res.stderr
    assert not (tmp_path / "none").exists()


def test_training_takes_a_dataset_dict_split(corpus, tiny_tokenizer_dir, tmp_path):
    """pretrain --data DIR --split NAME over a DatasetDict directory (written here with pyarrow, in the layout
    `datasets` writes); without a split (the Python API, eval) the error names the splits and what to give."""
    records = [{"body": r["text"]} for r in jsonl_records(corpus["pretrain"])]
    dd = write_saved_dataset_dict({"train": records[:3], "validation": records}, tmp_path / "dd")
    res = nf("pretrain", "--preset", "tiny", "--n-layers", 1, "--data", dd, "--split", "validation", "--tokenizer",
             tiny_tokenizer_dir, "--text-column", "body", "--out", tmp_path / "run", "--max-steps", 1,
             "--seq-len", 32, "--tensorboard", "false", "--eval-every", 0, "--quiet")
    assert res.returncode == 0, res.stderr
    [source] = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())["sources"]
    assert source["records"] == len(records) and Path(source["path"]) == dd / "validation"
    with pytest.raises(DataError, match=r"dd: a datasets DatasetDict with the splits train, validation: give one "
                                        r"split's directory \(.*dd/train\), or to a command that takes it --split"):
        prepare("pretrain", [dd], tiny_tokenizer_dir, tmp_path / "no", text_column="body")


def test_text_column_chooses_the_column(corpus, tiny_tokenizer, tmp_path):
    records = [{"id": i, "content": r["text"]} for i, r in enumerate(jsonl_records(corpus["pretrain"]))]
    parquet = write_parquet(records, tmp_path / "content.parquet")
    with pytest.raises(DataError, match=r"content.parquet: has no column 'text' \(its columns: id, content\); "
                                        r"choose the text column with --text-column"):
        prepare("pretrain", [parquet], tiny_tokenizer, tmp_path / "no")
    prepare("pretrain", [corpus["pretrain"]], tiny_tokenizer, tmp_path / "from_jsonl")
    prepare("pretrain", [parquet], tiny_tokenizer, tmp_path / "from_parquet", text_column="content")
    assert shard_bytes(tmp_path / "from_parquet") == shard_bytes(tmp_path / "from_jsonl")


def test_a_bad_row_is_named_by_file_and_row(tiny_tokenizer_dir, tmp_path):
    rows = [{"conversations": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(40)]
    rows[16]["conversations"][0]["role"] = "bot"
    parquet = write_parquet(rows, tmp_path / "bad.parquet")
    res = nf("prepare", "--kind", "sft", "--data", parquet, "--tokenizer", tiny_tokenizer_dir, "--out",
             tmp_path / "out", "--workers", 1)
    assert res.returncode == 1
    assert f"{parquet}:row 17: \"conversations\"[0].role:" in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()
    as_text = [{"conversations": json.dumps(r["conversations"])} for r in rows]  # a column of JSON text
    as_text[16]["conversations"] = "[not json"
    with pytest.raises(DataError, match=r"bad.parquet:row 17: \"conversations\": invalid JSON text"):
        prepare("sft", [write_parquet(as_text, tmp_path / "bad.parquet")], tiny_tokenizer_dir, tmp_path / "out2")


def test_pretrain_reads_parquet_directly(corpus, tiny_tokenizer_dir, tmp_path):
    records = [{"body": r["text"]} for r in jsonl_records(corpus["pretrain"])]
    parquet = write_parquet(records, tmp_path / "pre.parquet")
    untokenized = nf("pretrain", "--data", parquet, "--out", tmp_path / "run", "--max-steps", 1)
    assert untokenized.returncode == 1 and "give --tokenizer" in untokenized.stderr
    res = nf("pretrain", "--preset", "tiny", "--n-layers", 1, "--data", parquet, "--tokenizer", tiny_tokenizer_dir,
             "--text-column", "body", "--out", tmp_path / "run", "--max-steps", 2, "--seq-len", 32,
             "--tensorboard", "false", "--eval-every", 0, "--quiet")
    assert res.returncode == 0, res.stderr
    manifest = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())
    assert manifest["sources"][0]["path"].endswith("pre.parquet")
    assert manifest["sources"][0]["records"] == len(records)


def _damage(directory: Path, how: str) -> None:
    """A saved dataset's Arrow file (or state.json) broken in one way."""
    arrow = directory / "data-00000-of-00001.arrow"
    if how == "truncated":
        arrow.write_bytes(arrow.read_bytes()[:arrow.stat().st_size // 2])
    elif how == "empty":
        arrow.write_bytes(b"")
    elif how == "random-bytes":
        arrow.write_bytes(os.urandom(4096))
    elif how == "parquet-renamed":
        pq.write_table(pa.Table.from_pylist([{"text": "a"}]), arrow)
    elif how == "state-json":
        (directory / "state.json").write_text('{"_data_files": [')
    elif how == "second-file-without-text":  # the first file has the column, the second does not
        write_saved_dataset([{"body": "b"}], directory / "other")
        (directory / "other" / "data-00000-of-00001.arrow").rename(directory / "b.arrow")
        (directory / "state.json").write_text(json.dumps({"_data_files": [
            {"filename": "data-00000-of-00001.arrow"}, {"filename": "b.arrow"}]}))


BROKEN = [  # (id, damage, the command after `nanoforge`, words of the message)
    ("arrow-truncated", "truncated", "prepare", "{d}/data-00000-of-00001.arrow: cannot be read as an Arrow stream"),
    ("arrow-empty", "empty", "prepare", "{d}/data-00000-of-00001.arrow: cannot be read as an Arrow stream"),
    ("arrow-empty-for-pretrain", "empty", "pretrain", "{d}/data-00000-of-00001.arrow: cannot be read as an Arrow"),
    ("arrow-random-bytes", "random-bytes", "prepare", "{d}/data-00000-of-00001.arrow: cannot be read as an Arrow"),
    ("arrow-that-is-parquet", "parquet-renamed", "prepare", "{d}/data-00000-of-00001.arrow: cannot be read as an"),
    ("state-json-corrupt", "state-json", "prepare", "{d}/state.json: does not list the data files (_data_files)"),
    ("arrow-without-the-text-column", "second-file-without-text", "prepare",
     "{d}/b.arrow: has no column 'text' (its columns: body); choose the text column with --text-column"),
    ("parquet-truncated", None, "prepare", "{d}/x.parquet: cannot be read as Parquet"),
]


@pytest.fixture(scope="module")
def broken_outcomes(corpus, tiny_tokenizer_dir, tmp_path_factory):
    """Each broken dataset given to the real CLI (a few at a time), and the tree before and after all of them."""
    from conftest import tree_state
    work = tmp_path_factory.mktemp("broken_arrow")
    records = jsonl_records(corpus["pretrain"])[:64]
    commands = {}
    for case_id, how, command, _ in BROKEN:
        if how is None:
            data = write_parquet(records, (work / case_id).mkdir() or work / case_id / "x.parquet")
            data.write_bytes(data.read_bytes()[:-100])
        else:
            data = write_saved_dataset(records, work / case_id)
            _damage(data, how)
        args = ["--tokenizer", tiny_tokenizer_dir, "--out", work / f"out-{case_id}"]
        commands[case_id] = (["prepare", "--kind", "pretrain", "--data", data, *args, "--workers", 1]
                             if command == "prepare" else ["pretrain", "--data", data, *args, "--max-steps", 1])
    before = tree_state(work)
    with ThreadPoolExecutor(max_workers=3) as pool:
        runs = {case_id: pool.submit(nf, *args) for case_id, args in commands.items()}
        results = {case_id: run.result() for case_id, run in runs.items()}
    return work, results, before, tree_state(work)


@pytest.mark.slow
@pytest.mark.parametrize("case_id,how,command,words", BROKEN, ids=[c[0] for c in BROKEN])
def test_a_broken_arrow_or_parquet_file_is_named_and_nothing_is_written(broken_outcomes, case_id, how, command,
                                                                        words):
    work, results, before, after = broken_outcomes
    r = results[case_id]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert words.format(d=work / case_id) in r.stderr, r.stderr
    assert after == before, f"written or changed: {sorted(set(after.items()) ^ set(before.items()))}"


def test_a_broken_dataset_info_json_is_not_needed(corpus, tiny_tokenizer, tmp_path):
    """The Arrow files describe themselves; dataset_info.json is only how `datasets` finds its features."""
    saved = write_saved_dataset(jsonl_records(corpus["pretrain"]), tmp_path / "saved")
    (saved / "dataset_info.json").write_text("{not json")
    prepare("pretrain", [corpus["pretrain"]], tiny_tokenizer, tmp_path / "from_jsonl")
    prepare("pretrain", [saved], tiny_tokenizer, tmp_path / "from_arrow")
    assert shard_bytes(tmp_path / "from_arrow") == shard_bytes(tmp_path / "from_jsonl")
