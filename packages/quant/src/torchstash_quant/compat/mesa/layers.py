"""Mesa's layers: the torch layers with a ``quant_groups`` setting, plus ``MatMul``.

They compute exactly what the torch layers compute (they are subclasses); ``quant_groups``
only tells :func:`torchstash_quant.compat.mesa.policy.deploy_on_init` how many channel groups to
quantize this layer's saved tensors in. Functional code needs none of them: torchstash
reaches ``q @ k.transpose(-2, -1)`` and ``attn.softmax(-1)`` where they are written.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _Grouped:
    quant_groups: int | None

    def _set_groups(self, quant_groups: int | None) -> None:
        if quant_groups is not None and (
            isinstance(quant_groups, bool) or not isinstance(quant_groups, int) or quant_groups < 1
        ):
            raise ValueError(f"quant_groups={quant_groups!r} must be a positive integer")
        self.quant_groups = quant_groups


class GELU(nn.GELU, _Grouped):
    def __init__(self, *args: Any, quant_groups: int | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._set_groups(quant_groups)


class ReLU(nn.ReLU, _Grouped):
    def __init__(self, *args: Any, quant_groups: int | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._set_groups(quant_groups)


class Linear(nn.Linear, _Grouped):
    def __init__(self, *args: Any, quant_groups: int | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._set_groups(quant_groups)


class Conv2d(nn.Conv2d, _Grouped):
    def __init__(self, *args: Any, quant_groups: int | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._set_groups(quant_groups)


class LayerNorm(nn.LayerNorm, _Grouped):
    def __init__(self, *args: Any, quant_groups: int | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._set_groups(quant_groups)


class BatchNorm2d(nn.BatchNorm2d, _Grouped):
    def __init__(self, *args: Any, quant_groups: int | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._set_groups(quant_groups)


class Softmax(nn.Softmax, _Grouped):
    def __init__(self, dim: int | None = None, quant_groups: int | None = None) -> None:
        super().__init__(dim)
        self._set_groups(quant_groups)


class MatMul(nn.Module, _Grouped):
    """``MatMul()(a, b) == a @ b``, as a module (Mesa needed one to reach the op)."""

    def __init__(self, quant_groups: int | None = None) -> None:
        super().__init__()
        self._set_groups(quant_groups)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b
