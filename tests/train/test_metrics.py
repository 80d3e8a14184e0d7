"""The CPU matmul peak (MFU's denominator): measured once per machine and kept on disk, the highest figure
seen wins, and a broken or unwritable cache never stops a run."""
import json

import pytest
import torch

from nanoforge.train import metrics
from nanoforge.train.metrics import CPU_PEAK_FILE, cpu_peak_flops, cpu_peak_key, observed_peak, record_cpu_peak

CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache directory and process cache; measurements counted (and made fast) by a wrapper that
    still runs the real measurement."""
    monkeypatch.setenv("NANOFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(metrics, "_cpu_peak_cache", {})
    calls = []
    real = metrics.measure_cpu_matmul_flops

    def counted(precision):
        calls.append(precision)
        return real(precision, seconds=0.05, max_n=256)
    monkeypatch.setattr(metrics, "measure_cpu_matmul_flops", counted)
    return tmp_path / "cache" / CPU_PEAK_FILE, calls


def new_process(monkeypatch):
    """What a second run on the machine sees: the disk cache, but nothing in memory."""
    monkeypatch.setattr(metrics, "_cpu_peak_cache", {})


def test_peak_is_measured_once_then_read_back_from_disk(cache, monkeypatch):
    path, calls = cache
    first = metrics.peak_flops(CPU, "fp32")
    assert calls == ["fp32"] and first > 1e8  # a real measurement: over 0.1 GFLOP/s on any CPU
    assert json.loads(path.read_text()) == {cpu_peak_key("fp32"): first}
    new_process(monkeypatch)
    assert metrics.peak_flops(CPU, "fp32") == first
    assert calls == ["fp32"], "the second process read the cache instead of measuring"
    metrics.peak_flops(CPU, "bf16")  # another precision is another key
    assert calls == ["fp32", "bf16"] and set(json.loads(path.read_text())) == {cpu_peak_key("fp32"),
                                                                              cpu_peak_key("bf16")}
    assert not list(path.parent.glob("*.tmp-*"))


def test_a_seeded_cache_file_is_what_comes_back(cache):
    path, calls = cache
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({cpu_peak_key("bf16"): 123e9, "another machine | 64 threads | bf16": 9e12}))
    assert cpu_peak_flops("bf16") == 123e9 and calls == []
    key = cpu_peak_key("bf16")
    assert "threads" in key and "bf16" in key and torch.__version__ in key


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"KEY": "fast"}', '{"KEY": -1}', ""])
def test_a_corrupt_cache_is_measured_over_and_replaced(cache, content):
    path, calls = cache
    path.parent.mkdir(parents=True)
    path.write_text(content.replace("KEY", cpu_peak_key("fp32")))
    peak = cpu_peak_flops("fp32")
    assert calls == ["fp32"] and peak > 0
    assert json.loads(path.read_text()) == {cpu_peak_key("fp32"): peak}


def test_an_unwritable_cache_does_not_stop_the_run(tmp_path, monkeypatch, cache):
    _, calls = cache
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    # a cache dir below a plain file: mkdir fails even for root, which ignores permission bits
    monkeypatch.setenv("NANOFORGE_CACHE_DIR", str(blocker / "nanoforge"))
    assert cpu_peak_flops("fp32") > 0
    assert record_cpu_peak("fp32", 1e15) == 1e15  # still raised in this process
    # the cache file's name taken by a directory: unreadable and unreplaceable
    monkeypatch.setenv("NANOFORGE_CACHE_DIR", str(tmp_path / "dir_cache"))
    (tmp_path / "dir_cache" / CPU_PEAK_FILE).mkdir(parents=True)
    new_process(monkeypatch)
    assert cpu_peak_flops("fp32") > 0
    assert calls == ["fp32", "fp32"]


def test_the_highest_figure_seen_is_kept(cache, monkeypatch):
    path, calls = cache
    key = cpu_peak_key("fp32")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({key: 100e9}))
    assert record_cpu_peak("fp32", 50e9) == 100e9  # a slower figure never lowers it
    assert json.loads(path.read_text())[key] == 100e9
    assert record_cpu_peak("fp32", 150e9) == 150e9
    assert json.loads(path.read_text())[key] == 150e9
    new_process(monkeypatch)
    assert cpu_peak_flops("fp32") == 150e9 and calls == []
    # another process raised it meanwhile: a lower figure here comes back as the disk's higher one
    path.write_text(json.dumps({key: 200e9}))
    assert record_cpu_peak("fp32", 160e9) == 200e9


def test_a_run_faster_than_the_peak_becomes_the_peak(cache):
    path, _ = cache
    peak = cpu_peak_flops("fp32")
    assert observed_peak(CPU, "fp32", peak, peak / 2) == peak  # slower: MFU 50%, nothing changes
    assert observed_peak(CPU, "fp32", peak, 3 * peak) == 3 * peak  # faster: MFU 100%, and remembered
    assert json.loads(path.read_text())[cpu_peak_key("fp32")] == 3 * peak
    assert cpu_peak_flops("fp32") == 3 * peak
    assert observed_peak(CPU, "fp32", 0.0, 1e12) == 0.0  # no peak known: MFU stays unknown


def test_measuring_leaves_the_global_rng_alone(cache):
    state = torch.get_rng_state()
    metrics.measure_cpu_matmul_flops("bf16")
    assert torch.equal(torch.get_rng_state(), state)


def test_the_loop_never_logs_mfu_above_one(cache, tmp_path, monkeypatch):
    """A peak measured at a tenth of the truth (as on a loaded machine): the loop's MFU stays <= 1 and the
    cache is raised to the rate the run reached."""
    from nanoforge.core.config import ModelConfig, TrainConfig
    from nanoforge.model.gpt import GPT
    from nanoforge.train.loop import Stage, train
    from nanoforge.train.objectives import causal_lm_loss

    path, _ = cache
    key = cpu_peak_key("fp32")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({key: 1e6}))  # 1 MFLOP/s: any run beats it

    class Tokens:
        def next_batch(self):
            x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
            return {"input_ids": x[:, :-1], "labels": x[:, 1:]}

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    mcfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, max_seq_len=16)
    tcfg = TrainConfig(max_steps=3, batch_size=2, seq_len=16, log_every=1, save_every=0, eval_every=0,
                       warmup_steps=1, precision="fp32", device="cpu", tensorboard=False)
    train(Stage("pretrain", Tokens(), causal_lm_loss), GPT(mcfg), mcfg, tcfg, tmp_path / "run", quiet=True)
    mfus = [json.loads(line)["mfu"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(mfus) == 3 and all(0 < m <= 1.0 for m in mfus)
    assert mfus[0] == 1.0  # the first window set the new peak
    assert json.loads(path.read_text())[key] > 1e6


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100 pcie"),
    ("NVIDIA A100-SXM4-40GB", "a100"), ("NVIDIA A10", "a10"), ("NVIDIA L40S", "l40s"), ("NVIDIA L40", "l40"),
    ("NVIDIA L4", "l4"), ("NVIDIA GeForce RTX 3090", "3090"), ("NVIDIA GeForce RTX 4090", "4090"),
    ("Tesla T4", "t4"), ("Tesla V100-SXM2-16GB", "v100"), ("NVIDIA GeForce GTX 1080", None)])
def test_gpu_names_find_their_datasheet_entry(name, key):
    """torch.cuda.get_device_name() strings: the most specific entry wins (L40S is not an L40, A100 not an A10)."""
    assert metrics.gpu_table_entry(name) == key
