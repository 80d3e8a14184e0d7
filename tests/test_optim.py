import math

import pytest
import torch
from torch import nn

from nanoforge.config import TrainConfig
from nanoforge.train.optim import lr_at, param_groups


def cfg(**kw):
    return TrainConfig(**{"max_steps": 100, "warmup_steps": 10, "lr": 1.0, "min_lr_ratio": 0.1, **kw})


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "onecycle", "constant"])
def test_warmup_is_linear_and_reaches_peak(schedule):
    c = cfg(schedule=schedule)
    assert [lr_at(s, c) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert lr_at(9, c) == pytest.approx(1.0)


def test_cosine_ends_at_floor_and_passes_midpoint():
    c = cfg(schedule="cosine")
    assert lr_at(55, c) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(100, c) == pytest.approx(0.1)
    lrs = [lr_at(s, c) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_wsd_is_flat_then_decays_over_last_fraction():
    c = cfg(schedule="wsd", decay_fraction=0.2)
    assert lr_at(50, c) == 1.0 and lr_at(79, c) == 1.0
    assert lr_at(80, c) < 1.0
    assert lr_at(99, c) == pytest.approx(0.1)


def test_onecycle_is_linear_down():
    c = cfg(schedule="onecycle")
    assert lr_at(55, c) == pytest.approx(1.0 + (0.1 - 1.0) * 0.5)


def test_no_weight_decay_on_norms_biases_embeddings():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.lin = nn.Linear(4, 4)
            self.norm = nn.LayerNorm(4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight  # tied: must appear once

    m = M()
    groups = param_groups(m, 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    plain = {id(p) for p in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert decayed == {id(m.lin.weight)}
    assert plain == {id(m.emb.weight), id(m.lin.bias), id(m.norm.weight), id(m.norm.bias)}
    assert sum(len(g["params"]) for g in groups) == len(list(m.parameters()))
