"""Mesa's layers: the torch layers with Mesa's constructor arguments, plus ``MatMul``.

They compute exactly what the torch layers compute (they are subclasses); ``quant_groups``
tells :func:`torchstash_quant.compat.mesa.policy.deploy_on_init` how many channel groups to
quantize the layer's saved tensors in, and ``args``/``logger`` (Mesa's configuration and log)
are accepted and kept. Functional code needs none of them: torchstash reaches
``q @ k.transpose(-2, -1)`` and ``attn.softmax(-1)`` where they are written. A checkpoint of
Mesa's layers loads as it is: its running ranges (``clip_val``, ``shift``, ``iteration``,
which live in the compressor here) are dropped on loading.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: Mesa's quantizer state in its layers' state_dict (and their sub-quantizers' in Softmax's
#: and MatMul's): dropped when a Mesa checkpoint is loaded
MESA_STATE = ("clip_val", "shift", "iteration")


class _Mesa:
    """What every Mesa layer has beside its torch base: groups, tag, index, enable."""

    quant_groups: int | None
    tag = "fm"

    def _mesa_init(self, quant_groups: Any, args: Any, logger: Any, mesa: bool) -> None:
        if isinstance(quant_groups, (tuple, list)):
            quant_groups = quant_groups[0] if quant_groups else None
        if quant_groups is not None and (
            isinstance(quant_groups, bool) or not isinstance(quant_groups, int) or quant_groups < 1
        ):
            raise ValueError(f"quant_groups={quant_groups!r} must be a positive integer")
        self.quant_groups = quant_groups
        self.args, self.logger = args, logger
        #: set by ``deploy_on_init`` for the layers the policy enables (``mesa=True``: Mesa's
        #: early switch; the policy still decides)
        self.enable = bool(mesa)
        self.index = -1
        module: Any = self
        module._register_load_state_dict_pre_hook(_drop_mesa_state)


def _drop_mesa_state(state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix) :].split(".")
        if rest[-1] in MESA_STATE and (len(rest) == 1 or rest[0] in ("quant1", "quant2")):
            del state_dict[key]


class GELU(nn.GELU, _Mesa):
    tag = "gelu"

    def __init__(
        self,
        args: Any = None,
        logger: Any = None,
        quant_groups: int | None = None,
        approximate: str = "none",
        mesa: bool = False,
    ) -> None:
        super().__init__(approximate=approximate)
        self._mesa_init(quant_groups, args, logger, mesa)


class ReLU(nn.ReLU, _Mesa):
    tag = "relu"

    def __init__(
        self,
        inplace: bool = False,
        dim: int = 1,
        args: Any = None,
        logger: Any = None,
        quant_groups: int | None = None,
        mesa: bool = False,
    ) -> None:
        super().__init__(inplace)
        self.dim = dim  # Mesa's packing axis for the 1-bit mask (the mask is 1 bit here too)
        self._mesa_init(quant_groups, args, logger, mesa)


class Linear(nn.Linear, _Mesa):
    tag = "fc"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        args: Any = None,
        logger: Any = None,
        quant_groups: int | None = None,
        mesa: bool = False,
        **kw: Any,
    ) -> None:
        super().__init__(in_features, out_features, bias, **kw)
        self._mesa_init(quant_groups, args, logger, mesa)


class Conv2d(nn.Conv2d, _Mesa):
    tag = "conv"

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: Any,
        stride: Any = 1,
        padding: Any = 0,
        dilation: Any = 1,
        groups: int = 1,
        bias: bool = True,
        args: Any = None,
        logger: Any = None,
        quant_groups: int | None = None,
        mesa: bool = False,
        **kw: Any,
    ) -> None:
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, **kw
        )
        self._mesa_init(quant_groups, args, logger, mesa)


class LayerNorm(nn.LayerNorm, _Mesa):
    tag = "layernorm"

    def __init__(
        self,
        normalized_shape: Any,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        args: Any = None,
        logger: Any = None,
        quant_groups: int | None = None,
        mesa: bool = False,
        **kw: Any,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, **kw)
        self._mesa_init(quant_groups, args, logger, mesa)


class BatchNorm2d(nn.BatchNorm2d, _Mesa):
    tag = "bn"

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        args: Any = None,
        logger: Any = None,
        quant_groups: int | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, **kw)
        self._mesa_init(quant_groups, args, logger, False)


class Softmax(nn.Softmax, _Mesa):
    tag = "softmax"

    def __init__(
        self,
        dim: int | None = None,
        args: Any = None,
        logger: Any = None,
        quant_groups: int | None = None,
        mesa: bool = False,
    ) -> None:
        super().__init__(dim)
        self._mesa_init(quant_groups, args, logger, mesa)


class MatMul(nn.Module, _Mesa):
    """``MatMul()(a, b) == a @ b``, as a module (Mesa needed one to reach the op)."""

    tag = "matmul"

    def __init__(
        self,
        args: Any = None,
        logger: Any = None,
        quant_groups: int | None = None,
        mesa: bool = False,
    ) -> None:
        super().__init__()
        self._mesa_init(quant_groups, args, logger, mesa)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return x1.matmul(x2)
