import subprocess
import sys
from pathlib import Path

import pytest

from nanoforge.core.config import build_config
from nanoforge.core.errors import NanoforgeError
from nanoforge.model.gpt import GPT
from nanoforge.train.plan import GiB, RESERVED_FRACTION, activation_bytes, make_plan


def test_plan_counts_exact_state_and_fits_the_device():
    mcfg, tcfg = build_config("mini", None, {"precision": "bf16"})
    p = make_plan(mcfg, tcfg, "rtx3090", global_batch=256, tokens=1e9)
    n = GPT(mcfg).num_params()
    assert p.params == n and p.weights == 4 * n and p.optimizer == 8 * n
    fixed = p.weights + p.grads + p.optimizer
    budget = 24 * GiB * (1 - RESERVED_FRACTION)
    assert fixed + p.max_micro_batch * p.activations_per_sample <= budget
    assert fixed + (p.max_micro_batch + 1) * p.activations_per_sample > budget
    assert p.micro_batch <= p.max_micro_batch and p.global_batch >= 256 and p.global_batch - 256 < p.grad_accum
    # 1e9 tokens at 40% of a 3090's 71 TFLOP/s: tokens * flops / (peak * mfu)
    assert p.seconds == pytest.approx(1e9 * p.flops_per_token / (71e12 * 0.40))


def test_activations_scale_with_precision_and_sequence():
    mcfg, _ = build_config("mini")
    assert activation_bytes(mcfg, 1024, "bf16") > 1.9 * activation_bytes(mcfg, 512, "bf16")
    assert activation_bytes(mcfg, 512, "fp32") > activation_bytes(mcfg, 512, "bf16")


def test_too_big_a_model_is_a_clear_error():
    mcfg, tcfg = build_config(None, None, {"d_model": 8192, "n_layers": 40, "n_heads": 64, "n_kv_heads": 8})
    with pytest.raises(NanoforgeError, match="leave no room for activations on t4"):
        make_plan(mcfg, tcfg, "t4")
    with pytest.raises(NanoforgeError, match="known devices"):
        make_plan(mcfg, tcfg, "tpu")


def test_plan_command():
    r = subprocess.run([sys.executable, "-m", "nanoforge", "plan", "--preset", "mini", "--device", "h100",
                        "--tokens", "2e9", "--global-batch", "512"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr
    assert "25.8M parameters" in r.stdout and "projected wall time" in r.stdout and "largest micro-batch" in r.stdout
