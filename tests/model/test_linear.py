"""The model's Linear: the packed CPU path gives nn.Linear's outputs and never reads a stale weight."""
import pytest
import torch
import torch.nn.functional as F

from nanoforge.model import linear as packed
from nanoforge.model.linear import Linear

pytestmark = pytest.mark.skipif(not packed._AVAILABLE, reason="this torch has no oneDNN linear")


def test_packed_rows_match_f_linear_and_other_shapes_take_the_plain_path():
    torch.manual_seed(0)
    for rows in (1, 2, 5, 64, 65, 300):
        layer = Linear(48, 40, bias=True).requires_grad_(False)
        x = torch.randn(1, rows, 48)
        with torch.no_grad():
            got = layer(x)
        assert got.shape == (1, rows, 40)
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        # one row and long prefills keep MKL's path; a decode step's handful of rows reads the packed weight
        assert (layer._packed is not None) == (packed.PACKED_MIN_ROWS <= rows <= packed.PACKED_MAX_ROWS), rows


def test_grad_mode_trainable_weights_and_bf16_never_pack():
    layer = Linear(16, 8)
    y = layer(torch.randn(4, 16))
    assert y.requires_grad and layer._packed is None
    with torch.no_grad():
        layer(torch.randn(4, 16))  # a trainable weight, even without autograd (a policy sampling)
        assert layer._packed is None
        layer.requires_grad_(False).to(torch.bfloat16)(torch.randn(4, 16, dtype=torch.bfloat16))
    assert layer._packed is None


def test_a_policy_trained_by_fused_adamw_between_samples_never_reads_a_stale_weight():
    """Fused AdamW (the CPU optimizer here) updates weights without bumping their version counter: a copy keyed
    on it would go stale, which is why only frozen weights are packed."""
    torch.manual_seed(1)
    layer = Linear(32, 16, bias=False)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1, fused=True)
    x = torch.randn(8, 32)
    for _ in range(3):
        with torch.no_grad():
            sampled = layer(x)
        torch.testing.assert_close(sampled, F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
        layer(x).square().sum().backward()
        opt.step()
        opt.zero_grad()


def test_a_frozen_weight_changed_in_place_is_packed_again():
    torch.manual_seed(2)
    layer = Linear(32, 16, bias=False).requires_grad_(False)
    x = torch.randn(8, 32)
    with torch.no_grad():
        before = layer(x)
        assert layer._packed is not None
        layer.load_state_dict({"weight": torch.zeros(16, 32)})
        assert layer(x).abs().max() == 0
        layer.weight.copy_(torch.randn(16, 32))
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(before, layer(x))
