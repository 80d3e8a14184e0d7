"""Run reports: the numbers come from metrics.jsonl, the plots are real PNGs, and nothing crashes without
validation records or without matplotlib."""
import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from nanoforge.data.prepare import prepare_dataset
from nanoforge.core.errors import NanoforgeError
from nanoforge.infer.samples import DEFAULT_PROMPTS
from nanoforge.report.markdown import NO_MATPLOTLIB, count_params, write_report
from nanoforge.report.runs import read_run
from nanoforge.recipes.common import SAMPLE_MAX_TOKENS
from nanoforge.recipes.pretrain import pretrain
from nanoforge.recipes.sft import sft

FAST = {"tensorboard": False, "precision": "fp32", "device": "cpu", "max_steps": 12, "log_every": 2,
        "warmup_steps": 2, "save_every": 0}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_tokenizer):
    from conftest import tiny_corpus
    work = tmp_path_factory.mktemp("report_data")
    files = tiny_corpus(work)[:1]
    out = work / "pre"
    prepare_dataset("pretrain", files, tiny_tokenizer, out, val_fraction=0.1, workers=1, log=lambda *a: None)
    return out


# dropout on, so that anything drawing from the global RNG during sampling would change the losses
WITH_VAL = {**FAST, "eval_every": 4, "eval_batches": 2, "dropout": 0.1}


@pytest.fixture(scope="module")
def run_with_val(prepared, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "with_val"
    pretrain([str(prepared)], out, preset="tiny", overrides=WITH_VAL, quiet=True)
    return out


@pytest.fixture(scope="module")
def run_with_samples(prepared, tmp_path_factory):
    """The same run as run_with_val, with samples every 5 steps (and at the last), TensorBoard on, and a
    checkpoint at step 6 to resume from."""
    out = tmp_path_factory.mktemp("runs") / "sampled"
    pretrain([str(prepared)], out, preset="tiny", overrides={**WITH_VAL, "sample_every": 5, "tensorboard": True,
                                                             "save_every": 6, "keep_last": 5}, quiet=True)
    return out


@pytest.fixture(scope="module")
def run_without_val(prepared, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "no_val"
    pretrain([str(prepared)], out, preset="tiny", overrides={**FAST, "eval_every": 0}, quiet=True)
    return out


def records(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, after checking the signature: a truncated or non-PNG file fails."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    assert data[-8:-4] == b"IEND", f"{path} is truncated"
    return struct.unpack(">II", data[16:24])


def test_report_holds_the_logged_numbers_and_valid_pngs(run_with_val, tmp_path):
    pytest.importorskip("matplotlib")
    out = write_report([run_with_val], tmp_path / "r" / "report.md", title="my runs")
    text = out.read_text()
    train = [r for r in records(run_with_val) if "loss" in r]
    val = [r for r in records(run_with_val) if "val_loss" in r]
    assert len(val) == 3  # steps 4, 8, 12
    best = min(val, key=lambda r: r["val_loss"])
    assert text.startswith("# my runs")
    assert f"{train[0]['loss']:.4f} (step {train[0]['step']}) -> {train[-1]['loss']:.4f} (step 12)" in text
    assert f"{val[0]['val_loss']:.4f} (step 4) -> {val[-1]['val_loss']:.4f} (step 12)" in text
    assert f"best {best['val_loss']:.4f} (step {best['step']})" in text
    assert f"{val[0]['val_bpb']:.4f} -> {val[-1]['val_bpb']:.4f}" in text
    assert "| precision | fp32 on cpu |" in text
    assert "| stage | pretrain |" in text
    png = tmp_path / "r" / "report.png"
    assert f"]({png.name})" in text
    width, height = png_size(png)
    assert width >= 400 and height >= 200


def test_report_without_validation_records(run_without_val, tmp_path):
    out = write_report([run_without_val], tmp_path / "report.md")
    text = out.read_text()
    assert not [r for r in records(run_without_val) if "val_loss" in r]
    assert "none logged" in text
    last = [r for r in records(run_without_val) if "loss" in r][-1]
    assert f"{last['loss']:.4f} (step 12)" in text
    if has_matplotlib():
        png_size(tmp_path / "report.png")


def test_report_without_matplotlib_writes_a_note_instead(run_with_val, tmp_path, monkeypatch):
    # None in sys.modules makes `import matplotlib...` raise ImportError, as on a machine without it
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    out = write_report([run_with_val], tmp_path / "report.md")
    text = out.read_text()
    assert NO_MATPLOTLIB in text
    assert "validation loss" in text and "![" not in text
    assert not list(tmp_path.glob("*.png"))


def test_two_runs_samples_and_odd_lines(run_with_val, run_without_val, tmp_path):
    """Events and a line cut short by a kill are skipped; runs with the same name get distinct plots; sample
    replies with pipes and newlines stay inside their table cells."""
    copy = tmp_path / "a" / "with_val"
    shutil.copytree(run_with_val, copy)
    with open(copy / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 12, "event": "rollback", "to_step": 8}) + "\n")
        f.write('{"step": 13, "loss": 1.0, "l')
    samples = [{"question": "What does a|b do?", "reply": "It ors.\nTwice.", "finish_reason": "stop",
                "expected": "Bitwise or.", "held_out": True}]
    out = write_report([copy, run_with_val], tmp_path / "both.md", samples=samples, preamble="**hello**")
    text = out.read_text()
    assert "**hello**" in text
    assert "(step 13)" not in text
    assert "events: rollback" in text
    assert "## a-with_val" in text and f"## {run_with_val.parent.name}-with_val" in text  # told apart by parent
    assert "| What does a\\|b do? | It ors. Twice. | stop | Bitwise or. | yes |" in text
    if has_matplotlib():  # one per run, and the comparison
        assert sorted(p.name for p in tmp_path.glob("both_*.png")) == sorted([
            "both_comparison.png", "both_a-with_val.png", f"both_{run_with_val.parent.name}-with_val.png"])


def test_the_report_command_never_imports_torch(run_with_val, tmp_path):
    """`nanoforge report` reads files and writes markdown: torch (seconds to import, and absent from a machine that
    only reads runs) is never loaded, the parameter count and the checkpoint's tokens seen included."""
    code = ("import sys; from nanoforge.cli import main; code = main(['report', sys.argv[1], '--out', sys.argv[2]]); "
            "print('torch loaded' if 'torch' in sys.modules else 'no torch'); sys.exit(code)")
    out = tmp_path / "report.md"
    done = subprocess.run([sys.executable, "-c", code, str(run_with_val), str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("no torch"), done.stdout
    text = out.read_text()
    assert "| parameters |" in text and "| tokens seen |" in text


def test_a_directory_without_metrics_is_an_error_naming_it(tmp_path):
    with pytest.raises(NanoforgeError, match="no metrics.jsonl"):
        write_report([tmp_path], tmp_path / "report.md")
    with pytest.raises(NanoforgeError, match="no run directories"):
        write_report([], tmp_path / "report.md")


# ----------------------------------------------------------------------------------------------------------
# the report every training command writes, and samples during training


def losses(run_dir):
    return [(r["step"], r["loss"]) for r in records(run_dir) if "loss" in r]


def samples(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "samples.jsonl").read_text().splitlines()]


def table(text: str, heading: str) -> list[list[str]]:
    """The body rows of the markdown table under `heading`, as lists of cells."""
    lines = text.split(heading + "\n", 1)[1].lstrip("\n").splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split(" | ")])
    return rows


def referenced_pngs(report: Path) -> list[Path]:
    return [report.parent / name for name in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", report.read_text())]


def test_training_writes_a_report_whose_numbers_match_metrics(run_with_samples):
    report = run_with_samples / "report.md"
    text = report.read_text()
    assert text.startswith("# nanoforge pretrain report: sampled")
    if has_matplotlib():
        pngs = referenced_pngs(report)
        assert [p.name for p in pngs] == ["report.png"]
        for png in pngs:
            width, height = png_size(png)
            assert width >= 800 and height >= 400  # the 2 x 3 grid
    else:
        assert NO_MATPLOTLIB in text
    final = {row[0]: (float(row[1]), int(row[2])) for row in table(text, "### Final metrics")}
    last_train = [r for r in records(run_with_samples) if "loss" in r][-1]
    last_val = [r for r in records(run_with_samples) if "val_loss" in r][-1]
    for record, keys in ((last_train, ["loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_gb"]),
                         (last_val, ["val_loss", "val_ppl", "val_bpb"])):
        for key in keys:
            value, step = final[key]
            assert step == record["step"] == 12
            assert value == pytest.approx(record[key], rel=1e-5), key
    times = dict(row[:2] for row in table(text, "### Time"))
    assert times["tokens seen"].startswith("3,072 (12 steps)")  # 12 steps x 4 x 64 tokens
    assert "wall time" in times and "time in training steps" in times
    params = dict(row[:2] for row in table(text, "### Parameters"))
    assert params["total"] == f"{count_params(read_run(run_with_samples).config['model']):,}"
    data = dict(row[:2] for row in table(text, "### Data"))
    assert data["kind"] == "pretrain" and data["train"].endswith("documents, " + data["train"].split(", ")[-1])
    assert "[train]" in text and "sample_every = 5" in text  # the config as used


def test_samples_during_training_land_at_their_steps_and_in_the_report(run_with_samples, run_with_val):
    got = samples(run_with_samples)
    prompts = DEFAULT_PROMPTS
    assert [s["step"] for s in got] == [5] * len(prompts) + [10] * len(prompts) + [12] * len(prompts)
    assert [s["prompt"] for s in got[:len(prompts)]] == prompts
    assert all(0 < s["new_tokens"] <= SAMPLE_MAX_TOKENS for s in got)
    # sampling must not touch the training RNG stream: with dropout on, the losses equal a run without samples
    assert losses(run_with_samples) == losses(run_with_val)
    rows = table((run_with_samples / "report.md").read_text(), "### Samples (step 12)")
    assert [r[0] for r in rows] == prompts
    assert [r[1] for r in rows] == [" ".join(s["text"].split()).replace("|", "\\|") or "" for s in got[-len(prompts):]]
    # and in TensorBoard, as text
    events = b"".join(p.read_bytes() for p in (run_with_samples / "tb").glob("events.*"))
    assert b"samples/0" in events and b"samples/5" in events


def test_resumed_run_keeps_samples_and_losses_of_an_uninterrupted_one(run_with_samples, tmp_path):
    split = tmp_path / "split"
    shutil.copytree(run_with_samples, split)
    shutil.rmtree(split / "checkpoints" / "step_000012")  # as if killed after step 6's save, at step 12
    pretrain([], split, resume=True, quiet=True)
    assert losses(split) == losses(run_with_samples)
    assert samples(split) == samples(run_with_samples)  # step 10 and 12 samples dropped, then made again
    assert (split / "report.md").is_file()


def test_sample_prompts_from_a_file_and_a_bad_file_stops_before_training(prepared, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Once upon"}\n{"prompt": "春天"}\n', encoding="utf-8")
    run = tmp_path / "custom"
    pretrain([str(prepared)], run, preset="tiny", quiet=True,
             overrides={**FAST, "max_steps": 2, "sample_every": 2, "sample_prompts": str(prompts)})
    assert [(s["step"], s["prompt"]) for s in samples(run)] == [(2, "Once upon"), (2, "春天")]
    prompts.write_text('{"prompt": "fine"}\n{"text": "no prompt key"}\n', encoding="utf-8")
    with pytest.raises(NanoforgeError, match=r"prompts\.jsonl:2"):
        pretrain([str(prepared)], tmp_path / "bad", preset="tiny", quiet=True,
                 overrides={**FAST, "sample_every": 2, "sample_prompts": str(prompts)})
    assert not (tmp_path / "bad").exists()
    with pytest.raises(NanoforgeError, match="missing.txt"):
        pretrain([str(prepared)], tmp_path / "bad", preset="tiny", quiet=True,
                 overrides={**FAST, "sample_every": 2, "sample_prompts": str(tmp_path / "missing.txt")})


def test_a_failing_report_never_fails_the_run(prepared, tmp_path, monkeypatch, capsys):
    import nanoforge.report.markdown

    def broken(*args, **kwargs):
        raise OSError("No space left on device")
    monkeypatch.setattr(nanoforge.report.markdown, "write_report", broken)
    summary = pretrain([str(prepared)], tmp_path / "r", preset="tiny", overrides={**FAST, "max_steps": 2}, quiet=True)
    assert summary["step"] == 2 and "report" not in summary
    assert (tmp_path / "r" / "checkpoints" / "step_000002" / "model.safetensors").is_file()
    assert "report could not be written: OSError: No space left on device" in capsys.readouterr().err


def test_comparing_runs_lists_each_side_by_side(run_with_val, run_without_val, tmp_path):
    out = write_report([run_with_val, run_without_val], tmp_path / "cmp.md")
    text = out.read_text()
    header = text.split("## Comparison\n\n", 1)[1].splitlines()[0]
    assert header == "| | with_val | no_val |"
    rows = {row[0]: row[1:] for row in table(text, "## Comparison")}
    last_loss = [r for r in records(run_with_val) if "loss" in r][-1]["loss"]
    assert float(rows["final training loss"][0]) == pytest.approx(last_loss, rel=1e-5)
    assert rows["final validation loss"][1] == "-"  # no_val has none
    assert "## with_val" in text and "## no_val" in text
    if has_matplotlib():
        assert {p.name for p in referenced_pngs(out)} == {"cmp_comparison.png", "cmp_with_val.png", "cmp_no_val.png"}
        for png in referenced_pngs(out):
            png_size(png)


def test_sft_stage_samples_through_the_chat_template_and_reports(run_with_val, tmp_path, shared_data):
    """SFT samples go through the chat template; the run ends with its report."""
    out = tmp_path / "sft"
    sft(str(run_with_val), [str(shared_data / "tiny" / "sft_tiny.jsonl")], out,
        overrides={**FAST, "max_steps": 2, "sample_every": 2, "eval_every": 0, "val_fraction": 0.0}, quiet=True)
    got = samples(out)
    assert [s["step"] for s in got] == [2] * len(DEFAULT_PROMPTS)
    # a chat sample stops at <|im_end|> or runs out of tokens; never continues into another turn's markup
    assert all("<|im_start|>" not in s["text"] for s in got if s["finish_reason"] == "stop")
    text = (out / "report.md").read_text()
    assert "| stage | sft |" in text and "### Samples (step 2)" in text
    # LoRA: the loop hands the sampler the adapter wrapper; samples come from the GPT carrying the adapters
    from nanoforge.model.lora import LoraConfig
    sft(str(run_with_val), [str(shared_data / "tiny" / "sft_tiny.jsonl")], tmp_path / "lora", lora=LoraConfig(rank=4),
        overrides={**FAST, "max_steps": 2, "sample_every": 2, "eval_every": 0, "val_fraction": 0.0}, quiet=True)
    assert [s["step"] for s in samples(tmp_path / "lora")] == [2] * len(DEFAULT_PROMPTS)
    assert "| stage | lora |" in (tmp_path / "lora" / "report.md").read_text()


def test_a_run_stopped_by_sigterm_still_writes_its_report(prepared, tmp_path):
    """The real command, stopped by SIGTERM once it has logged and checkpointed a few steps: it exits 143 with
    its checkpoint, and its report holds the numbers of the last logged step."""
    import os
    import signal
    import subprocess

    from nanoforge.weights import checkpoint as ckpt

    out = tmp_path / "stopped"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "nanoforge", "pretrain", "--data", str(prepared), "--out", str(out),
           "--preset", "tiny", "--max-steps", "100000", "--precision", "fp32", "--device", "cpu", "--log-every", "1",
           "--save-every", "2", "--eval-every", "0", "--tensorboard", "false"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1], env=env)
    try:
        for line in proc.stderr:  # the progress line of step 3: step 2's checkpoint is written by then
            if line.startswith("step ") and line.split()[1].split("/")[0] == "3":
                break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err and "SIGTERM received: checkpoint written to" in err, err[-2000:]
    last = [r for r in records(out) if "loss" in r][-1]
    assert ckpt.load_state(ckpt.latest_checkpoint(out))["run_state"]["step"] == last["step"] >= 3
    text = (out / "report.md").read_text()
    assert text.startswith("# nanoforge pretrain report: stopped")
    assert "> Stopped early: SIGTERM received" in text
    final = {row[0]: (float(row[1]), int(row[2])) for row in table(text, "### Final metrics")}
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_gb"):
        value, step = final[key]
        assert step == last["step"]
        assert value == pytest.approx(last[key], rel=1e-5), key
    if has_matplotlib():
        for png in referenced_pngs(out / "report.md"):
            png_size(png)


def wandb_records(run_file: Path) -> Iterator:
    """The protobuf records of an offline run's .wandb file: a LevelDB-style log (32 KiB blocks of [crc32, length,
    type] + data; after a 7-byte ':W&B' header), which wandb's own Python reader no longer ships."""
    from wandb.proto import wandb_internal_pb2

    data, pending, pos, block = run_file.read_bytes(), b"", 7, 32768
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a FULL record, or the LAST piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_history(run_file: Path) -> list[dict]:
    """The history rows (one per wandb.log call) of an offline run's .wandb file."""
    rows = []
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            row: dict = {}
            for item in record.history.item:  # a logged table is a nested key per field: samples/_type, ...
                *outer, key = list(item.nested_key) or [item.key]
                node = row
                for name in outer:
                    node = node.setdefault(name, {})
                node[key] = json.loads(item.value_json)
            rows.append(row)
    return rows


@pytest.mark.slow
def test_wandb_offline_gets_the_metrics_and_the_samples(prepared, tmp_path):
    """A real run with wandb_project set, wandb offline (no network, no login): the losses of metrics.jsonl
    and the samples of samples.jsonl are in what wandb wrote."""
    pytest.importorskip("wandb")
    import os
    import subprocess

    out = tmp_path / "wb"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
           "WANDB_DATA_DIR": str(tmp_path / "wandb_data"), "WANDB_API_KEY": "", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "nanoforge", "pretrain", "--data", str(prepared), "--out", str(out),
           "--preset", "tiny", "--max-steps", "4", "--log-every", "2", "--sample-every", "2", "--eval-every", "0",
           "--save-every", "0", "--precision", "fp32", "--device", "cpu", "--tensorboard", "false",
           "--wandb-project", "nanoforge-test"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-3000:]
    [run] = (out / "wandb").glob("offline-run-*")
    history = wandb_history(next(run.glob("*.wandb")))
    logged = {row["_step"]: row["loss"] for row in history if "loss" in row}
    assert logged == {rec["step"]: rec["loss"] for rec in records(out) if "loss" in rec} and list(logged) == [2, 4]
    tables = {row["_step"]: row["samples"] for row in history if "samples" in row}
    assert list(tables) == [2, 4] and all(t["_type"] == "table-file" for t in tables.values())
    # the tables themselves: files beside the run, rows (step, prompt, text) as in samples.jsonl
    got = samples(out)
    for step, ref in tables.items():
        table = json.loads((run / "files" / ref["path"]).read_text())
        assert table["columns"] == ["step", "prompt", "text"]
        assert table["data"] == [[s["step"], s["prompt"], s["text"]] for s in got if s["step"] == step]


def test_comparing_runs_validated_on_different_amounts_says_so(prepared, run_with_val, tmp_path):
    """val_count is logged with every evaluation (supervised tokens scored); a report comparing runs whose
    validation covered different amounts (here batch 2 vs the tiny preset's 4, eval_batches 2) shows each
    count and warns; the same run twice does not."""
    small = tmp_path / "batch2"
    pretrain([str(prepared)], small, preset="tiny", overrides={**WITH_VAL, "batch_size": 2}, quiet=True)
    n_small = [r["val_count"] for r in records(small) if "val_loss" in r]
    n_big = [r["val_count"] for r in records(run_with_val) if "val_loss" in r]
    seq = 64  # the tiny preset's seq_len: each window scores seq_len tokens
    assert set(n_small) == {2 * 2 * seq} and set(n_big) == {2 * 4 * seq}
    text = write_report([small, run_with_val], tmp_path / "cmp.md").read_text()
    assert f"| validation scored on | {2 * 2 * seq:,} tokens | {2 * 4 * seq:,} tokens |" in text
    assert "means over different amounts of validation data" in text
    assert f"each over {2 * 2 * seq:,} tokens" in text  # the per-run summary says it too
    copy = tmp_path / "again"
    shutil.copytree(run_with_val, copy)
    same = write_report([run_with_val, copy], tmp_path / "same.md").read_text()
    assert "different amounts of validation data" not in same


def test_eval_of_a_run_defaults_to_its_whole_validation_split(run_with_val, prepared, tmp_path):
    """`nanoforge eval RUN` with nothing else scores every token of the run's own val split (training's own
    validation may be capped); --split picks another; a directory without such data is a clear error."""
    from nanoforge.data.shards import read_manifest
    from nanoforge.eval.options import EvalOptions
    from nanoforge.eval.run import run_eval
    said = []
    got = run_eval(run_with_val, EvalOptions(quiet=True), log=said.append)["data"]
    val_tokens = read_manifest(prepared)["splits"]["val"]["tokens"]
    assert got["tokens"] == val_tokens and any("the val split of" in s for s in said)
    whole = run_eval(run_with_val, EvalOptions(data=[str(prepared)], quiet=True), log=lambda *a: None)["data"]
    assert whole["tokens"] == val_tokens + read_manifest(prepared)["splits"]["train"]["tokens"]
    alone = tmp_path / "stray"
    shutil.copytree(run_with_val / "checkpoints", alone / "checkpoints")
    shutil.copytree(run_with_val / "tokenizer", alone / "tokenizer")
    (alone / "config.toml").write_text((run_with_val / "config.toml").read_text().replace(str(prepared.resolve()),
                                                                                           str(tmp_path / "gone")))
    with pytest.raises(NanoforgeError, match="no prepared data with a validation split to default to"):
        run_eval(alone, EvalOptions(quiet=True), log=lambda *a: None)
