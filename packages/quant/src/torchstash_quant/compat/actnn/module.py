"""ActNN's ``QModule``: the model with the current level applied, in place.

ActNN rebuilt every supported layer as a Q-layer, freshly initialized (the weights and
BatchNorm statistics were lost unless loaded afterwards), and reached only ``nn`` layers.
Here the level is applied to the model through torchstash: functional ops are reached too,
and ``state_dict`` is the model's own, as ActNN's stripped ``model.`` from its keys. The
layers ActNN converted become its Q-classes in place (their class changes; weights, forward
and keys stay), so ``print(model)`` shows ``QConv2d``, ``QBatchNorm2d``... as ActNN's README
has users check, and ``isinstance`` holds for both the Q-class and the torch class.
``train()``/``eval()`` set ``config.training``, as ActNN's did.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

import torchstash as ts

from . import layers as qlayers
from .conf import config, strategy
from .layers import _Quantized

#: The torch layers ActNN's ``QModule`` converted, in the order it checked them: each
#: ``nn.<name>`` into ``Q<name>``.
_CONVERTED_NAMES = (
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "Linear",
    "ReLU",
    "MaxPool2d",
    "AvgPool2d",
)
_CONVERTED: tuple[tuple[type[nn.Module], type[nn.Module]], ...] = tuple(
    (getattr(nn, name), getattr(qlayers, f"Q{name}")) for name in _CONVERTED_NAMES
)
_BATCHNORMS = (qlayers.QBatchNorm1d, qlayers.QBatchNorm2d, qlayers.QBatchNorm3d)
_SUBCLASSES: dict[tuple[type[nn.Module], type[nn.Module]], type[nn.Module]] = {}


def _subclass(q: type[nn.Module], layer: type[nn.Module]) -> type[nn.Module]:
    """For a subclass of a torch layer, ``q`` and the subclass under ``q``'s name (one class
    per pair): the subclass's own forward and attributes stay."""
    if (q, layer) not in _SUBCLASSES:
        _SUBCLASSES[q, layer] = type(q.__name__, (q, layer), {})
    return _SUBCLASSES[q, layer]


def _q_class_of(layer: nn.Module) -> type[nn.Module] | None:
    """The Q-class ActNN would have made of ``layer`` (BatchNorm only with
    ``config.enable_quantized_bn``, as ActNN's)."""
    for base, q in _CONVERTED:
        if isinstance(layer, base):
            if q in _BATCHNORMS and not config.enable_quantized_bn:
                return None
            return q if type(layer) is base else _subclass(q, type(layer))
    return None


def _convert(module: nn.Module, done: list[tuple[nn.Module, type[nn.Module]]]) -> None:
    """Give ActNN's layers their Q-class, as ActNN's ``convert_layers`` walked the children
    (a Q-layer already is one; anything else is searched)."""
    for child in module.children():
        if isinstance(child, _Quantized):
            continue
        q = _q_class_of(child)
        if q is None:
            _convert(child, done)
            continue
        done.append((child, type(child)))
        child.__class__ = q


class QModule(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        name, options = strategy(batchnorm=False)
        self.handle: ts.Handle | None = (
            ts.apply(model, name, **options) if name is not None else None
        )
        self._converted: list[tuple[nn.Module, type[nn.Module]]] = []
        _convert(model, self._converted)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def train(self, mode: bool = True) -> QModule:
        config.training = mode
        return super().train(mode)

    def eval(self) -> QModule:
        config.training = False
        return super().eval()

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # the wrapped model's keys
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        return self.model.load_state_dict(state_dict, *args, **kwargs)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self.model.named_parameters(*args, **kwargs)

    def remove(self) -> nn.Module:
        """Take torchstash off and return the plain model, its layers of their torch classes
        again (one whose class changed since, a lazy layer's, keeps it)."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        for layer, cls in reversed(self._converted):
            if isinstance(layer, _Quantized):
                layer.__class__ = cls
        self._converted.clear()
        return self.model
