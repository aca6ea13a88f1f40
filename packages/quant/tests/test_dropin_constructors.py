"""Mesa's and ActNN's layers take their arguments as the upstream layers did: the torch
layer's first, positionally or by name, then the project's own; the result is the torch
layer with those arguments."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from torchstash_quant.compat import actnn
from torchstash_quant.compat.mesa import layers as mesa


def _same(a: nn.Module, b: nn.Module) -> None:
    assert {k: v.shape for k, v in a.state_dict().items()} == {
        k: v.shape for k, v in b.state_dict().items()
    }
    skip = {"training", "_parameters", "_buffers", "_modules"}
    for key, value in vars(b).items():
        if not key.startswith("_") and key not in skip:
            assert getattr(a, key) == value, key


@pytest.mark.parametrize(
    ("ours", "torch_layer"),
    [
        (lambda: mesa.Linear(4, 8, False, None, None, 2, True), lambda: nn.Linear(4, 8, False)),
        (
            lambda: mesa.Conv2d(3, 8, 3, 2, 1, 1, 1, False, None, None, 2),
            lambda: nn.Conv2d(3, 8, 3, 2, 1, 1, 1, False),
        ),
        (lambda: mesa.LayerNorm(8, 1e-6, False), lambda: nn.LayerNorm(8, 1e-6, False)),
        (
            lambda: mesa.BatchNorm2d(8, 1e-3, 0.2, True, False, None, None, 4),
            lambda: nn.BatchNorm2d(8, 1e-3, 0.2, True, False),
        ),
        (lambda: mesa.Softmax(-1, None, None, 4), lambda: nn.Softmax(-1)),
        (lambda: mesa.GELU(None, None, 2, "tanh"), lambda: nn.GELU("tanh")),
        (lambda: mesa.ReLU(True, 2), lambda: nn.ReLU(True)),
        (
            lambda: actnn.QConv2d(3, 8, 3, 2, 1, 1, 1, False, "reflect", 1),
            lambda: nn.Conv2d(3, 8, 3, 2, 1, 1, 1, False, "reflect"),
        ),
        (
            lambda: actnn.QConvTranspose2d(3, 8, 3, 2, 1, 1, 1, True, 1, "zeros", 1),
            lambda: nn.ConvTranspose2d(3, 8, 3, 2, 1, 1, 1, True, 1, "zeros"),
        ),
        (
            lambda: actnn.QBatchNorm1d(8, 1e-3, 0.2, True, True, 1),
            lambda: nn.BatchNorm1d(8, 1e-3, 0.2),
        ),
        (lambda: actnn.QLinear(input_features=4, output_features=8), lambda: nn.Linear(4, 8)),
    ],
)
def test_positional_arguments_land_where_upstream_put_them(
    ours: Callable[[], nn.Module], torch_layer: Callable[[], nn.Module]
) -> None:
    torch.manual_seed(0)
    _same(ours(), torch_layer())


def test_the_projects_own_arguments() -> None:
    assert mesa.Linear(4, 8, quant_groups=3, mesa=True).quant_groups == 3
    assert mesa.Linear(4, 8, True, None, None, 3, True).enable
    assert mesa.ReLU(True, 2).dim == 2 and mesa.ReLU().dim == 1
    assert mesa.Linear(4, 8, dtype=torch.float64).weight.dtype == torch.float64  # torch's own
    assert actnn.QConv2d(3, 8, 3, group=1).kernel_size == (3, 3)


def test_bad_calls_say_what_python_would() -> None:
    with pytest.raises(TypeError, match="at most 7 positional arguments"):
        mesa.Linear(4, 8, True, None, None, 2, True, 5)
    with pytest.raises(TypeError, match="multiple values for argument 'in_features'"):
        mesa.Linear(4, 8, in_features=4)
    with pytest.raises(TypeError, match="mesa"):
        mesa.BatchNorm2d(8, mesa=True)  # Mesa's BatchNorm had no early switch
    with pytest.raises(TypeError, match="multiple values for argument 'group'"):
        actnn.QConv2d(3, 8, 3, 1, 0, 1, 1, True, "zeros", 2, group=3)
    with pytest.raises(TypeError, match="at most"):
        actnn.QLinear(4, 8, True, 0, 1)
