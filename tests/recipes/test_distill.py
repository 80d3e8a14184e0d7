"""Distillation: the student's KL to the teacher falls; tokenizers must match; the stage resumes."""
import json

import pytest
import torch

from conftest import prepare_tiny
from nanoforge.data.prepare import prepare_dataset
from nanoforge.core.errors import NanoforgeError
from nanoforge.train.objectives import make_distill_loss
from nanoforge.recipes.distill import distill
from nanoforge.recipes.options import DistillOptions
from nanoforge.recipes.pretrain import pretrain

FAST = {"tensorboard": False, "log_every": 5, "eval_every": 0, "precision": "fp32", "warmup_steps": 2,
        "seq_len": 64}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("teacher")
    prepare_tiny(root / "data", tiny_tokenizer)
    pretrain([str(root / "data")], root / "run", preset="tiny",
             overrides={**FAST, "max_steps": 60, "lr": 3e-3}, quiet=True)
    return root


def kls(run):
    return [json.loads(l)["kl"] for l in (run / "metrics.jsonl").read_text().splitlines() if "kl" in l]


def test_student_kl_to_teacher_falls(teacher, tmp_path):
    # a smaller fresh student of a different shape than the tiny teacher (d_model 64)
    out = tmp_path / "student"
    s = distill(str(teacher / "run"), "tiny", [str(teacher / "data")], out,
                overrides={**FAST, "d_model": 32, "n_layers": 1, "max_steps": 40, "lr": 5e-3},
                options=DistillOptions(temperature=2.0, alpha=0.2), quiet=True)
    k = kls(out)
    assert k[-1] < 0.7 * k[0], k
    assert s["step"] == 40
    # resuming keeps the teacher and options from the run's config
    s = distill(None, None, [], out, overrides={"max_steps": 45}, resume=True, quiet=True)
    assert s["step"] == 45


def test_loss_mixes_ce_and_kl_as_documented():
    from nanoforge.core.config import ModelConfig
    from nanoforge.model.gpt import GPT
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=16)
    student, teach = GPT(cfg), GPT(cfg)
    x = torch.randint(0, 50, (2, 8))
    labels = torch.randint(0, 50, (2, 8))
    labels[0, :3] = -100
    loss_sum, n, extras = make_distill_loss(teach, temperature=2.0, alpha=0.3)(student, {"input_ids": x, "labels": labels})
    keep = labels != -100
    s, t = student(x)[keep], teach(x)[keep]
    ce = torch.nn.functional.cross_entropy(s, labels[keep], reduction="sum")
    p_t = torch.softmax(t / 2, -1)
    kl = (p_t * (torch.log(p_t) - torch.log_softmax(s / 2, -1))).sum()
    assert n == keep.sum()
    torch.testing.assert_close(loss_sum, 0.3 * ce + 0.7 * 4 * kl, rtol=1e-4, atol=1e-4)
    # a student identical to its teacher has zero KL
    _, _, same = make_distill_loss(student, 2.0, 0.5)(student, {"input_ids": x, "labels": labels})
    assert same["kl"].abs() < 1e-6


def test_tokenizer_mismatch_is_a_clear_error(teacher, tmp_path):
    from nanoforge.data.sources import train_tokenizer
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"other words number {i} here"}) + "\n" for i in range(300)))
    other_tok = train_tokenizer([corpus], vocab_size=300, out_dir=tmp_path / "tok")
    prepare_dataset("pretrain", [corpus], other_tok, tmp_path / "d", val_fraction=0.1, workers=1, log=lambda *a: None)
    pretrain([str(tmp_path / "d")], tmp_path / "other", preset="tiny", overrides={**FAST, "max_steps": 1}, quiet=True)
    with pytest.raises(NanoforgeError, match="different tokenizer|not the teacher's"):
        distill(str(teacher / "run"), str(tmp_path / "other"), [str(teacher / "data")], tmp_path / "s",
                overrides=FAST, quiet=True)
    with pytest.raises(NanoforgeError, match="--teacher is required"):
        distill(None, "tiny", [str(teacher / "data")], tmp_path / "s2", quiet=True)
