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
        layer = Linear(48, 40, bias=True)
        x = torch.randn(1, rows, 48)
        with torch.no_grad():
            got = layer(x)
        assert got.shape == (1, rows, 40)
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        # one row and long prefills keep MKL's path; a decode step's handful of rows reads the packed weight
        assert (layer._packed is not None) == (packed.PACKED_MIN_ROWS <= rows <= packed.PACKED_MAX_ROWS), rows


def test_grad_mode_and_bf16_never_pack():
    layer = Linear(16, 8)
    y = layer(torch.randn(4, 16))
    assert y.requires_grad and layer._packed is None
    with torch.no_grad():
        layer.to(torch.bfloat16)(torch.randn(4, 16, dtype=torch.bfloat16))
    assert layer._packed is None


def test_a_changed_weight_is_packed_again():
    torch.manual_seed(1)
    layer = Linear(32, 16, bias=False)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    x = torch.randn(8, 32)
    with torch.no_grad():
        before = layer(x)
    layer(x).square().sum().backward()
    opt.step()  # an in-place update, as between RL rollouts
    with torch.no_grad():
        after = layer(x)
        torch.testing.assert_close(after, F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(before, after)
        layer.load_state_dict({"weight": torch.zeros(16, 32)})
        assert layer(x).abs().max() == 0
