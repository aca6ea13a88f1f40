"""ActNN's ``QModule``: the model with the current level applied, in place.

ActNN rebuilt every supported layer as a Q-layer, freshly initialized (the weights and
BatchNorm statistics were lost unless loaded afterwards), and reached only ``nn`` layers.
Here the level is applied to the model through torchstash: no layer is rebuilt, functional
ops are reached too, and ``state_dict`` is the model's own, as ActNN's stripped ``model.``
from its keys. ``train()``/``eval()`` set ``config.training``, as ActNN's did.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

import torchstash as ts

from .conf import config, strategy


class QModule(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        name, options = strategy(batchnorm=False)
        self.handle: ts.Handle | None = (
            ts.apply(model, name, **options) if name is not None else None
        )

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
        """Take torchstash off and return the plain model."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        return self.model
