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

from .._arguments import bind

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


#: Mesa's own arguments, after the torch layer's in every constructor
MESA_ARGS = ("args", "logger", "quant_groups", "mesa")


def _constructor(order: tuple[str, ...]) -> Any:
    """An ``__init__`` taking the arguments named in ``order``, positionally in that order or
    by name (Mesa's layers put theirs after the torch layer's), and any more of the torch
    layer's by name: Mesa's own go to :meth:`_Mesa._mesa_init`, ``dim`` (ReLU's mask axis in
    Mesa) is kept, the rest go to the torch layer."""

    def __init__(self: Any, *positional: Any, **named: Any) -> None:
        named = bind(type(self).__name__, order, positional, named)
        mesa = {k: named.pop(k) for k in MESA_ARGS if k in named and k in order}
        dim = named.pop("dim", 1) if isinstance(self, nn.ReLU) else None
        base: Any = next(c for c in type(self).__mro__ if c.__module__.startswith("torch.nn"))
        base.__init__(self, **named)
        if dim is not None:
            self.dim = dim  # Mesa's packing axis for the 1-bit mask (1 bit here too)
        self._mesa_init(
            mesa.get("quant_groups"), mesa.get("args"), mesa.get("logger"), mesa.get("mesa", False)
        )

    return __init__


class GELU(nn.GELU, _Mesa):
    tag = "gelu"
    __init__ = _constructor(("args", "logger", "quant_groups", "approximate", "mesa"))


class ReLU(nn.ReLU, _Mesa):
    tag = "relu"
    __init__ = _constructor(("inplace", "dim", *MESA_ARGS))


class Linear(nn.Linear, _Mesa):
    tag = "fc"
    __init__ = _constructor(("in_features", "out_features", "bias", *MESA_ARGS))


_CONV_ARGS: tuple[str, ...] = ("in_channels", "out_channels", "kernel_size", "stride")
_CONV_ARGS += ("padding", "dilation", "groups", "bias")  # two lines: one would be formatted as ten


class Conv2d(nn.Conv2d, _Mesa):
    tag = "conv"
    __init__ = _constructor((*_CONV_ARGS, *MESA_ARGS))


class LayerNorm(nn.LayerNorm, _Mesa):
    tag = "layernorm"
    __init__ = _constructor(("normalized_shape", "eps", "elementwise_affine", *MESA_ARGS))


class BatchNorm2d(nn.BatchNorm2d, _Mesa):
    """Mesa's BatchNorm takes no early switch (``mesa``): the policy decides."""

    tag = "bn"
    __init__ = _constructor(
        ("num_features", "eps", "momentum", "affine", "track_running_stats", *MESA_ARGS[:3])
    )


class Softmax(nn.Softmax, _Mesa):
    tag = "softmax"
    __init__ = _constructor(("dim", *MESA_ARGS))


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
