"""--micro-batch auto|N: the largest micro-batch that fits, the global batch kept by accumulation."""
import json
import re

import pytest
import torch
from safetensors.torch import load_file

from conftest import prepare_tiny
from nanoforge.core.config import build_config
from nanoforge.core.config import ConfigError
from nanoforge.core.errors import NanoforgeError
from nanoforge.train.microbatch import divisors_doubling, fit_micro_batch
from nanoforge.weights import checkpoint as ckpt
from nanoforge.recipes.pretrain import pretrain

FAST = {"tensorboard": False, "log_every": 1, "eval_every": 0, "precision": "fp32", "warmup_steps": 2,
        "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "seq_len": 32, "max_seq_len": 64}


def settle(budget_gb: float, micro: str = "auto", batch: int = 32, accum: int = 1, device: str = "cpu", rows=1,
           loss_fn=None):
    mcfg, tcfg = build_config("tiny", None, {"batch_size": batch, "grad_accum": accum, "micro_batch": micro,
                                             "memory_budget_gb": budget_gb, "device": device})
    said = []
    fit_micro_batch(mcfg, tcfg, log=said.append, rows_per_item=rows, loss_fn=loss_fn)
    return tcfg, said[0]


def test_a_smaller_budget_gives_a_smaller_micro_batch_and_keeps_the_global_batch():
    roomy, why_roomy = settle(4.0)
    tight, why_tight = settle(0.05)  # tiny: ~8 MB of weights, gradients and AdamW state, a few MB per sequence
    assert (roomy.batch_size, roomy.grad_accum) == (32, 1)
    assert tight.batch_size < 32 and tight.batch_size * tight.grad_accum == 32
    for why in (why_roomy, why_tight):  # what was chosen and why is always said
        assert "global batch 32" in why and "MiB per sequence" in why and "--memory-budget-gb" in why
    assert f"micro-batch {tight.batch_size} x grad-accum {tight.grad_accum}" in why_tight


def test_dpo_pairs_take_twice_the_room_of_a_sequence():
    seqs, why_seqs = settle(0.1)
    pairs, why = settle(0.1, rows=2)
    assert "items of 2 sequences" in why and pairs.batch_size * pairs.grad_accum == 32
    # each call probes anew and the measurements differ by a few MiB, so compare the counts that fit (the
    # micro-batches are rounded to divisors of 32 and may coincide)
    fit_seqs = int(re.search(r"up to (\d+) sequences", why_seqs).group(1))
    fit_pairs = int(re.search(r"up to (\d+) items", why).group(1))
    assert fit_pairs < 0.8 * fit_seqs, (why_seqs, why)


def test_distillation_probes_with_its_teacher():
    """The probe steps run the stage's own objective: a teacher's forward and its logits per sequence make
    fewer sequences fit than next-token loss alone."""
    from nanoforge.model.gpt import GPT
    from nanoforge.train.objectives import make_distill_loss
    mcfg, _ = build_config("tiny", None, {"n_layers": 8, "d_model": 128})  # a teacher bigger than the student
    teacher = GPT(mcfg).eval().requires_grad_(False)
    _, why_plain = settle(0.2)
    _, why_distill = settle(0.2, loss_fn=make_distill_loss(teacher))
    fit_plain = int(re.search(r"up to (\d+) sequences", why_plain).group(1))
    fit_distill = int(re.search(r"up to (\d+) sequences", why_distill).group(1))
    assert fit_distill < 0.8 * fit_plain, (why_plain, why_distill)


def test_nothing_fits_falls_back_to_one_sequence_per_micro_batch():
    tcfg, why = settle(0.0001, batch=4, accum=2)
    assert (tcfg.batch_size, tcfg.grad_accum) == (1, 8) and "even 1 is over the budget" in why


def test_a_fixed_micro_batch_must_divide_the_global_batch():
    tcfg, why = settle(0, micro="4", batch=8)
    assert (tcfg.batch_size, tcfg.grad_accum) == (4, 2) and "as given" in why
    with pytest.raises(NanoforgeError, match="does not divide the global batch"):
        settle(0, micro="3", batch=8)
    with pytest.raises(ConfigError, match="micro_batch"):
        build_config("tiny", None, {"micro_batch": "lots"})


def test_probe_sizes_double_and_divide_the_global_batch():
    assert divisors_doubling(32) == [1, 2, 4, 8, 16, 32]
    assert divisors_doubling(12) == [1, 2, 4, 12]
    assert divisors_doubling(1) == [1]


@pytest.fixture(scope="module")
def pretrain_dir(tmp_path_factory, tiny_tokenizer):
    return prepare_tiny(tmp_path_factory.mktemp("microbatch") / "pre", tiny_tokenizer)


def test_auto_micro_batch_trains_like_the_fixed_global_batch(pretrain_dir, tmp_path):
    """The loop normalises by the whole step's tokens and micro-batches take consecutive windows of the same
    order, so 8 sequences as 1 x 8 accumulation steps (a budget nothing fits) equal 8 x 1 up to float
    summation order."""
    pretrain([str(pretrain_dir)], tmp_path / "fixed", preset="tiny",
             overrides={**FAST, "max_steps": 3, "batch_size": 8, "grad_accum": 1}, quiet=True)
    pretrain([str(pretrain_dir)], tmp_path / "auto", preset="tiny",
             overrides={**FAST, "max_steps": 3, "batch_size": 8, "grad_accum": 1, "micro_batch": "auto",
                        "memory_budget_gb": 0.0001}, quiet=True)
    saved = (tmp_path / "auto" / "config.toml").read_text()
    assert "batch_size = 1\n" in saved and "grad_accum = 8\n" in saved  # it did split the batch
    la, lb = ([json.loads(l)["loss"] for l in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
               if "loss" in json.loads(l)] for run in ("fixed", "auto"))
    assert len(la) == len(lb) == 3 and la == pytest.approx(lb, rel=1e-5)
    a, b = (load_file(str(ckpt.latest_checkpoint(tmp_path / run) / "model.safetensors")) for run in ("fixed", "auto"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)  # Adam normalises: summation-order noise


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA probe needs a GPU")
def test_cuda_probe_respects_the_budget():
    roomy, why = settle(0, device="cuda")
    assert (roomy.batch_size, roomy.grad_accum) == (32, 1) and "probed real steps" in why
    tight, _ = settle(0.02, device="cuda")
    assert tight.batch_size < 32 and tight.batch_size * tight.grad_accum == 32
