"""Every bad output, a clear answer: an --out that is, holds or sits inside one of the command's inputs; an --out
on a read-only file system or on a disk that fills; a `prepare` stopped by SIGTERM or killed.

Each runs the real `nanoforge` command and checks exit status 1 (143 for SIGTERM), the one-line message, no
traceback, nothing half-written beside --out (no temporary directory either) and the inputs byte-identical.
docs/bad-inputs.md lists these cases with the messages observed here.

A read-only place: a directory chmod 0555 for an ordinary user; root writes there all the same, so as root the
test writes under /sys, where no one may create an entry (skipped where even that is allowed). A full disk: the
command runs with RLIMIT_FSIZE (SIGXFSZ ignored), so a write past the limit fails with EFBIG, a real OS error at
the write itself, as ENOSPC would."""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from conftest import prepare_tiny, save_random_run, tiny_corpus, tree_state, write_sum_prompts
from nanoforge.core import dirlock
from nanoforge.core.fsutil import remove_stale_temps
from nanoforge.data.prepare import SplitWriter, prepare_dataset

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
TRAIN = ["--max-steps", "1", "--device", "cpu", "--tensorboard", "false", "--seq-len", "32"]
APART = "choose an --out apart from its inputs"


def nf(args: list[str], file_size_limit: int | None = None) -> subprocess.CompletedProcess:
    """`python -m nanoforge ARGS`; with file_size_limit, no file it writes may grow past that many bytes."""
    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))
    return subprocess.run([sys.executable, "-m", "nanoforge", *args], capture_output=True, text=True, cwd=ROOT,
                          env=ENV, stdin=subprocess.DEVNULL, timeout=300,
                          preexec_fn=limit_file_size if file_size_limit else None)


def read_only_place(tmp: Path) -> Path:
    """A directory no command can create anything in (see the module's docstring)."""
    if os.geteuid() != 0:
        place = tmp / "read-only"
        place.mkdir()
        place.chmod(0o555)
        return place
    try:
        Path("/sys/nanoforge-probe").mkdir()
    except OSError:
        return Path("/sys")
    Path("/sys/nanoforge-probe").rmdir()
    pytest.skip("running as root, and /sys takes new entries here: no read-only place to write to")


def write_text_records(path: Path, megabytes: float) -> Path:
    """A pretraining JSONL file of about `megabytes`, the tiny corpus's lines over and over."""
    lines = [line for line in tiny_corpus(path.parent)[0].read_text(encoding="utf-8").splitlines() if line.strip()]
    with open(path, "w", encoding="utf-8") as f:
        written, i = 0, 0
        while written < megabytes * 1e6:
            text = json.loads(lines[i % len(lines)])["text"]
            written += f.write(json.dumps({"text": f"{text} ({i})"}, ensure_ascii=False) + "\n")
            i += 1
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_tokenizer, tiny_tokenizer_dir):
    """A saved run, prepared data, a raw JSONL file in its own folder, RL prompts: the inputs the cases name."""
    work = tmp_path_factory.mktemp("bad_outputs_world")
    save_random_run(work / "run", tiny_tokenizer, max_seq_len=128)
    prepare_tiny(work / "pre", tiny_tokenizer)
    (work / "d").mkdir()
    shutil.copy(tiny_corpus(work)[0], work / "d" / "in.jsonl")
    (work / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 6.2}\n')  # for `report`
    (work / "o").mkdir()
    write_sum_prompts(work / "o")
    os.link(work / "d" / "in.jsonl", work / "o" / "hard.jsonl")
    for i in (1, 2):  # the two parts of one input, for `prepare merge`
        prepare_dataset("pretrain", [work / "d" / "in.jsonl"], tiny_tokenizer, work / f"p{i}", workers=1,
                        part=f"{i}/2", log=lambda *a: None)
    return {"tok": tiny_tokenizer_dir, "run": work / "run", "pre": work / "pre", "d": work / "d",
            "o": work / "o", "p1": work / "p1", "p2": work / "p2", "work": work}


# (id, command, words expected in stderr): each must exit 1 with the words, leaving every input byte-identical
# and writing nothing. {run} a saved run, {pre} prepared data, {d} a folder holding in.jsonl, {o} a folder
# holding prompts.jsonl, {tok} a tokenizer, {t} the case's own folder ({t}/link points at {run}).
OVERLAPS = [
    ("prepare-out-holds-its-input",
     ["prepare", "--kind", "pretrain", "--data", "{d}/in.jsonl", "--tokenizer", "{tok}", "--out", "{d}", "--force"],
     ["--out {d} would write over its input {d}/in.jsonl (it holds it)", APART]),
    ("prepare-out-inside-its-tokenizer",
     ["prepare", "--kind", "pretrain", "--data", "{d}/in.jsonl", "--tokenizer", "{tok}", "--out", "{tok}/data"],
     ["--out {tok}/data would write over its input {tok} (it is inside it)"]),
    ("pretrain-out-inside-its-data", ["pretrain", "--data", "{pre}", "--out", "{pre}/run", *TRAIN],
     ["--out {pre}/run would write over its input {pre} (it is inside it)"]),
    ("distill-out-inside-its-teacher",
     ["distill", "--teacher", "{run}", "--init", "tiny", "--data", "{pre}", "--out", "{run}/student", *TRAIN],
     ["--out {run}/student would write over its input {run} (it is inside it)"]),
    ("grpo-out-holds-its-prompts", ["grpo", "--init", "{run}", "--data", "{o}/prompts.jsonl", "--out", "{o}", *TRAIN],
     ["--out {o} would write over its input {o}/prompts.jsonl (it holds it)"]),
    ("export-out-is-the-run", ["export", "{run}", "--out", "{run}", "--force"],
     ["--out {run} would write over its input {run} (it is that input)"]),
    ("export-out-is-a-link-to-the-run", ["export", "{run}", "--out", "{t}/link", "--force"],
     ["--out {t}/link would write over its input {run} (it is that input)"]),
    ("export-gguf-into-the-run", ["export", "{run}", "--format", "gguf", "--out", "{run}"],
     ["--out {run}/model.gguf would write over its input {run} (it is inside it)"]),
    ("lora-merge-out-is-the-run", ["lora", "merge", "{run}", "--out", "{run}"],
     ["--out {run} would write over its input {run} (it is that input)"]),
    ("tokenizer-train-out-holds-its-input",
     ["tokenizer", "train", "--data", "{d}/in.jsonl", "--vocab-size", "300", "--out", "{d}", "--force"],
     ["--out {d} would write over its input {d}/in.jsonl (it holds it)"]),
    ("tokenizer-train-onto-a-runs-tokenizer",
     ["tokenizer", "train", "--data", "{d}/in.jsonl", "--vocab-size", "300", "--out", "{run}/tokenizer"],
     ["{run}/tokenizer: already exists and is not empty; pass --force to replace it"]),
    ("report-out-is-the-runs-metrics", ["report", "{run}", "--out", "{run}/metrics.jsonl"],
     ["--out {run}/metrics.jsonl would write over its input {run}/metrics.jsonl (it is that input)"]),
    ("report-out-in-a-checkpoint", ["report", "{run}", "--out", "{run}/checkpoints/step_000000/model.safetensors"],
     ["would write over its input {run}/checkpoints (it is inside it)"]),
    ("eval-json-is-its-data", ["eval", "{run}", "--data", "{d}/in.jsonl", "--json", "{d}/in.jsonl"],
     ["--json {d}/in.jsonl would write over its input {d}/in.jsonl (it is that input)"]),
    ("eval-json-is-a-hard-link-to-its-data", ["eval", "{run}", "--data", "{d}/in.jsonl", "--json", "{o}/hard.jsonl"],
     ["--json {o}/hard.jsonl would write over its input {d}/in.jsonl (it is that input)"]),
    ("bench-json-into-its-data", ["bench", "--preset", "tiny", "--data", "{pre}", "--json", "{pre}/manifest.json"],
     ["--json {pre}/manifest.json would write over its input {pre} (it is inside it)"]),
    ("tokenizer-train-out-is-a-file",
     ["tokenizer", "train", "--data", "{d}/in.jsonl", "--vocab-size", "300", "--out", "{o}/prompts.jsonl"],
     ["{o}/prompts.jsonl: exists and is not a directory; choose another --out"]),
]
# (id, command with {ro} a read-only place): exit 1, "cannot write OUT: ..." and nothing written.
READ_ONLY = [
    ("prepare", ["prepare", "--kind", "pretrain", "--data", "{d}/in.jsonl", "--tokenizer", "{tok}", "--out",
                 "{ro}/nf/out"]),
    ("prepare-merge", ["prepare", "merge", "{p1}", "{p2}", "--out", "{ro}/nf/out"]),
    ("tokenizer-train", ["tokenizer", "train", "--data", "{d}/in.jsonl", "--vocab-size", "300", "--out",
                         "{ro}/nf/tok"]),
    ("export-hf", ["export", "{run}", "--out", "{ro}/nf/hf"]),
    ("export-gguf", ["export", "{run}", "--format", "gguf", "--out", "{ro}/nf/model.gguf"]),
    ("pretrain", ["pretrain", "--data", "{pre}", "--out", "{ro}/nf/run", *TRAIN]),
    ("sft", ["sft", "--init", "{run}", "--data", "{d}/in.jsonl", "--out", "{ro}/nf/run", *TRAIN]),
    ("grpo", ["grpo", "--init", "{run}", "--data", "{o}/prompts.jsonl", "--out", "{ro}/nf/run", *TRAIN]),
    ("report", ["report", "{run}", "--out", "{ro}/nf/r.md"]),
    ("eval-json", ["eval", "{run}", "--data", "{d}/in.jsonl", "--max-tokens", "2000", "--quiet", "--json",
                   "{ro}/nf/r.json"]),
    ("bench-json", ["bench", "--preset", "tiny", "--steps", "1", "--warmup", "0", "--quiet", "--json",
                    "{ro}/nf/b.json"]),
]
# (id, command writing {t}/out, file size limit): exit 1, "cannot write {t}/out: ..." and nothing left behind.
FULL_DISK = [
    ("prepare", ["prepare", "--kind", "pretrain", "--data", "{t}/big.jsonl", "--tokenizer", "{tok}", "--out", "{t}/out",
                 "--workers", "1"], 100_000),
    ("prepare-with-workers", ["prepare", "--kind", "pretrain", "--data", "{t}/big.jsonl", "--tokenizer", "{tok}",
                              "--out", "{t}/out", "--workers", "2"], 100_000),
    ("export-hf", ["export", "{run}", "--out", "{t}/out"], 100_000),
    ("export-gguf", ["export", "{run}", "--format", "gguf", "--out", "{t}/out"], 100_000),
    ("tokenizer-train", ["tokenizer", "train", "--data", "{d}/in.jsonl", "--vocab-size", "300", "--out", "{t}/out"],
     5_000),
]


def fill(text: str, **places) -> str:
    return text.format(**{k: str(v) for k, v in places.items()})


def assert_one_line_error(r: subprocess.CompletedProcess, words: list[str]) -> None:
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr[-3000:]
    for word in words:
        assert word in r.stderr, r.stderr


def assert_nothing_beside(out: Path) -> None:
    """No `out`, and nothing named after it beside it (a temporary directory, a lock file)."""
    assert not out.exists(), f"{out} was written"
    assert not list(out.parent.glob(f".*{out.name}*")), f"left beside {out}: {list(out.parent.glob(f'.*{out.name}*'))}"


def run_all(jobs: dict[str, tuple]) -> dict[str, subprocess.CompletedProcess]:
    """nf(*job) for every job, three at a time (each is a fresh Python importing torch: that is the cost)."""
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {key: pool.submit(nf, *job) for key, job in jobs.items()}
        return {key: f.result() for key, f in futures.items()}


@pytest.fixture(scope="module")
def overlap_outcomes(world, tmp_path_factory):
    watched = [world[k] for k in ("tok", "run", "pre", "d", "o", "p1", "p2")]
    before = {p: tree_state(p) for p in watched}
    jobs, places = {}, {}
    for case_id, args, _ in OVERLAPS:
        t = tmp_path_factory.mktemp(case_id)
        (t / "link").symlink_to(world["run"], target_is_directory=True)
        places[case_id] = {**world, "t": t}
        jobs[case_id] = ([fill(a, **places[case_id]) for a in args],)
    results = run_all(jobs)
    return {cid: (results[cid], places[cid]) for cid in jobs}, before, {p: tree_state(p) for p in watched}


@pytest.mark.slow
@pytest.mark.parametrize("case_id,args,words", OVERLAPS, ids=[c[0] for c in OVERLAPS])
def test_an_out_that_is_holds_or_sits_in_an_input_is_refused(overlap_outcomes, case_id, args, words):
    outcomes, before, after = overlap_outcomes
    r, places = outcomes[case_id]
    assert_one_line_error(r, [fill(w, **places) for w in words])
    assert before == after, "an input was changed"
    assert sorted(p.name for p in places["t"].iterdir()) == ["link"], "something was written"


def test_a_report_inside_the_run_it_reads_is_written(world, tmp_path):
    """RUN/report.md is a report's usual place (training writes one there): the rule refuses only the run's own
    files (weights/layout.read_parts), and leaves them unchanged."""
    run = shutil.copytree(world["run"], tmp_path / "run")
    before = tree_state(run)
    r = nf(["report", str(run), "--out", str(run / "report.md")])
    assert r.returncode == 0, r.stderr[-3000:]
    after = tree_state(run)
    assert {p: after[p] for p in before} == before and set(after) - set(before) <= {run / "report.md",
                                                                                   run / "report.png"}


@pytest.mark.slow
def test_an_out_on_a_read_only_file_system_is_one_line(world, tmp_path):
    ro = read_only_place(tmp_path)
    watched = [world[k] for k in ("tok", "run", "pre", "d", "o", "p1", "p2")]
    before = {p: tree_state(p) for p in watched}
    results = run_all({cid: ([fill(a, **world, ro=ro) for a in args],) for cid, args in READ_ONLY})
    try:
        for case_id, args in READ_ONLY:
            out = args[args.index("--out" if "--out" in args else "--json") + 1]
            assert_one_line_error(results[case_id], [f"error: cannot write {fill(out, ro=ro)}: "])
            assert not (ro / "nf").exists()
        assert before == {p: tree_state(p) for p in watched}, "an input was changed"
    finally:
        if ro.is_relative_to(tmp_path):
            ro.chmod(0o755)


@pytest.mark.slow
def test_a_disk_that_fills_is_one_line_and_leaves_nothing(world, tmp_path_factory):
    watched = [world[k] for k in ("tok", "run", "d")]
    before = {p: tree_state(p) for p in watched}
    jobs, places = {}, {}
    for case_id, args, limit in FULL_DISK:
        places[case_id] = {**world, "t": tmp_path_factory.mktemp(case_id)}
        if "{t}/big.jsonl" in args:
            write_text_records(places[case_id]["t"] / "big.jsonl", 1.0)  # ~200 KB of tokens: past the limit
        jobs[case_id] = ([fill(a, **places[case_id]) for a in args], limit)
    results = run_all(jobs)
    for case_id in places:
        out = places[case_id]["t"] / "out"
        assert_one_line_error(results[case_id], [f"error: cannot write {out}: "])
        assert_nothing_beside(out)
    assert "File too large" in results["prepare"].stderr and "File too large" in results["export-hf"].stderr
    assert before == {p: tree_state(p) for p in watched}, "an input was changed"


def start_prepare(data: Path, tokenizer: Path, out: Path) -> subprocess.Popen:
    """A `prepare` with two workers, returned once its first shard is being written (its temporary directory
    beside `out`, pid in the name, holds train_00000.bin)."""
    proc = subprocess.Popen([sys.executable, "-m", "nanoforge", "prepare", "--kind", "pretrain", "--data", str(data),
                             "--tokenizer", str(tokenizer), "--out", str(out), "--workers", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)
    shard = out.parent / f".{out.name}.tmp-{proc.pid}" / "train_00000.bin"
    deadline = time.monotonic() + 120
    while not (shard.is_file() and shard.stat().st_size) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"prepare ended before it could be stopped: {proc.communicate()}"
    assert shard.is_file(), "prepare wrote no shard in 2 minutes"
    return proc


@pytest.fixture(scope="module")
def big_input(tmp_path_factory) -> Path:
    """About 32 MB of pretraining text: many chunks, so a prepare is still at work when it is stopped."""
    return write_text_records(tmp_path_factory.mktemp("big_input") / "big.jsonl", 32)


@pytest.mark.slow
def test_sigterm_to_prepare_with_workers_exits_quietly_and_cleans_up(big_input, tiny_tokenizer_dir, tmp_path):
    before = tree_state(big_input.parent)
    proc = start_prepare(big_input, tiny_tokenizer_dir, tmp_path / "out")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert err.strip() == "interrupted", err[-3000:]  # no worker's traceback
    assert list(tmp_path.iterdir()) == [], "a temporary directory, a lock file or a shard was left"
    assert tree_state(big_input.parent) == before


@pytest.mark.slow
def test_the_next_prepare_removes_what_a_killed_one_left(big_input, tiny_tokenizer_dir, world, tmp_path):
    proc = start_prepare(big_input, tiny_tokenizer_dir, tmp_path / "out")
    proc.kill()
    _, err = proc.communicate(timeout=120)  # its stderr ends once its workers (who share it) have ended too
    assert "Traceback" not in err and len(err.splitlines()) <= 2, err[-3000:]  # workers go with their parent
    assert (tmp_path / f".out.tmp-{proc.pid}").is_dir()  # what a SIGKILL leaves: nothing can clean up
    r = nf(["prepare", "--kind", "pretrain", "--data", str(world["d"] / "in.jsonl"), "--tokenizer",
            str(tiny_tokenizer_dir), "--out", str(tmp_path / "out"), "--workers", "1"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "the killed prepare's temporary directory is left"


# (id, command writing {t}/OUT, OUT, what it writes beside OUT): a writer killed with SIGKILL leaves its temporary
# `.OUT.tmp-PID` (fsutil.temp_for: a directory, or a file for a one-file output); the next run into OUT removes it.
STALE = [
    ("export-hf", ["export", "{run}", "--out", "{t}/out"], "out", []),
    ("export-gguf", ["export", "{run}", "--format", "gguf", "--out", "{t}/m.gguf"], "m.gguf", ["m.gguf.sha256"]),
    ("export-minimind", ["export", "{t}/src.pth", "--tokenizer", "{tok}", "--format", "minimind", "--out",
                         "{t}/m.pth"], "m.pth", ["m.pth.sha256", "src.pth", "src.pth.sha256"]),
    ("tokenizer-train", ["tokenizer", "train", "--data", "{d}/in.jsonl", "--vocab-size", "300", "--out", "{t}/out"],
     "out", []),
]


@pytest.mark.slow
def test_the_next_export_or_tokenizer_train_removes_what_a_killed_one_left(world, tmp_path_factory):
    """The debris is made as a kill leaves it (a killed export or tokenizer train has it only for the moments of
    its write: too short to hit with a signal reliably); the removal is prepare's (dirlock.output_lock)."""
    import torch

    from nanoforge.core.config import build_config
    from nanoforge.model.gpt import GPT
    from nanoforge.weights.minimind import write_pth
    dead = subprocess.Popen(["true"])  # a pid no process has now, as a killed writer's
    dead.wait()
    jobs, places = {}, {}
    for case_id, args, out, _ in STALE:
        t = places[case_id] = tmp_path_factory.mktemp(case_id)
        debris = t / f".{out}.tmp-{dead.pid}"
        if out == "out":  # a directory output's: partly written
            debris.mkdir()
            (debris / "tokenizer.json").write_bytes(b"{")
        else:
            debris.write_bytes(b"GGUF")
        jobs[case_id] = ([fill(a, **world, t=t) for a in args],)
    mcfg = build_config("minimind-3", None, {"d_model": 64, "n_layers": 1})[0]
    write_pth(GPT(mcfg), places["export-minimind"] / "src.pth", dtype=torch.float32)
    results = run_all(jobs)
    for case_id, _, out, beside in STALE:
        assert results[case_id].returncode == 0, results[case_id].stderr[-3000:]
        assert sorted(p.name for p in places[case_id].iterdir()) == sorted([out, *beside]), case_id


def test_a_temporary_directory_of_a_live_prepare_is_never_removed(world, tiny_tokenizer_dir, tmp_path):
    out = tmp_path / "out"
    live = tmp_path / ".out.tmp-12345"  # as a prepare at work would have it: it holds the lock
    with dirlock.output_lock(out, f"{out} (being prepared)"):
        live.mkdir()
        r = nf(["prepare", "--kind", "pretrain", "--data", str(world["d"] / "in.jsonl"), "--tokenizer",
                str(tiny_tokenizer_dir), "--out", str(out), "--workers", "1"])
        assert_one_line_error(r, [f"{out} (being prepared) is in use by another process"])
        assert live.is_dir()
    assert live.is_dir() and not out.exists()


def test_only_temporary_directories_of_the_output_are_stale(tmp_path):
    out = tmp_path / "out"
    kept = [tmp_path / n for n in (".out.tmp-abc", ".out2.tmp-1", ".tmp-out-1", "out.tmp-1", ".out.lock")]
    stale = [tmp_path / n for n in (".out.tmp-1", ".out.tmp-99999")]
    for path in kept[:-1] + stale:
        path.mkdir()
    kept[-1].write_text("")
    (tmp_path / ".out.tmp-7").write_text("a one-file output's temporary (export --format gguf)")
    remove_stale_temps(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in kept)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a device every write to fails: ENOSPC)")
def test_a_shard_abandoned_on_a_full_disk_is_closed_without_a_second_error(tmp_path):
    """What is still buffered when a prepare fails on a full disk cannot be flushed either: dropping it must not
    raise, or the clean-up after it (the temporary directory) never runs."""
    writer = SplitWriter(tmp_path, "train", np.dtype(np.uint16), with_mask=False, max_shard_tokens=1000)
    for suffix in ("bin", "idx"):
        (tmp_path / f"train_00000.{suffix}").symlink_to("/dev/full")
    writer.write(np.arange(10), np.array([10]), 40, None)  # a few bytes: buffered, not yet on the "disk"
    writer.abort()


@pytest.fixture
def full_file_system(tmp_path):
    """A 300 KB tmpfs: a real ENOSPC. Only where this process may mount one (root with CAP_SYS_ADMIN)."""
    place = tmp_path / "small"
    place.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(place)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root with CAP_SYS_ADMIN); RLIMIT_FSIZE covers the rest")
    yield place
    subprocess.run(["umount", str(place)], check=True)


@pytest.mark.slow
def test_a_full_file_system_is_one_line_and_leaves_nothing(world, full_file_system, tmp_path):
    data = write_text_records(tmp_path / "big.jsonl", 1.0)
    jobs = {"prepare": (["prepare", "--kind", "pretrain", "--data", str(data), "--tokenizer", str(world["tok"]),
                         "--out", str(full_file_system / "out"), "--workers", "2"],),
            "export-hf": (["export", str(world["run"]), "--out", str(full_file_system / "hf")],),
            # raw JSONL: prepared into RUN/data first, where the disk fills
            "pretrain": (["pretrain", "--data", str(data), "--tokenizer", str(world["tok"]), "--out",
                          str(full_file_system / "run"), "--preset", "tiny", *TRAIN],)}
    before = tree_state(world["work"])
    results = run_all(jobs)
    for name, (args,) in jobs.items():
        out = Path(args[args.index("--out") + 1])
        assert_one_line_error(results[name], [f"error: cannot write {out}", ": No space left on device"])
    assert list(full_file_system.iterdir()) == []
    assert tree_state(world["work"]) == before
