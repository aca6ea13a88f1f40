"""ActNN's ``QScheme``: the per-layer record its adaptive layers kept, with the class
attributes its users set (``QScheme.num_samples``, ``QScheme.batch``, ``update_scale``).

The allocation itself is ``quant.auto``'s, which estimates each site's sensitivity from the
training step (the gradient at the op's output, the codes' step): the scheme keeps ActNN's
gradient scale (``set_scale``/``get_scale``) for code that reads it, and the registry of
layers, but decides nothing.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from .conf import config


class QScheme:
    num_samples: ClassVar[int] = 1
    num_layers: ClassVar[int] = 0
    batch: ClassVar[Any] = None
    update_scale: ClassVar[bool] = True
    layers: ClassVar[list[QScheme]] = []
    prev_layer: ClassVar[QScheme | None] = None

    def __init__(
        self, layer: Any, group: int = 0, num_locations: int = 1, depthwise_groups: int = 1
    ) -> None:
        self.initial_bits = config.initial_bits
        self.bits = config.activation_compression_bits[
            min(group, len(config.activation_compression_bits) - 1)
        ]
        if config.use_gradient:
            if QScheme.num_samples <= 1:
                raise ValueError(
                    "config.use_gradient needs QScheme.num_samples set to the dataset's size"
                )
            self.scales = torch.zeros(QScheme.num_samples)
        else:
            self.scales = torch.tensor([0.0])
        QScheme.layers.append(self)
        self.C: Any = None
        self.dim: Any = None
        self.num_locations = num_locations
        self.depthwise_groups = depthwise_groups
        self.layer = layer
        self.group = group
        self.name = f"layer_{QScheme.num_layers}"
        QScheme.num_layers += 1

    def get_scale(self) -> torch.Tensor:
        """The gradient scale: per sample of ``QScheme.batch`` with ``use_gradient`` (unseen
        samples at the mean), else the layer's."""
        if config.use_gradient:
            scale = self.scales[QScheme.batch].clone()
            avg = scale.sum() / max(int((scale != 0).sum()), 1)
            return torch.where(scale == 0, avg + 1e-9, scale)
        return self.scales

    def set_scale(self, grad: torch.Tensor) -> None:
        """Update the scale from the output gradient ``grad`` (per-sample squared norms)."""
        if not QScheme.update_scale:
            return
        norms = grad.detach().float().reshape(grad.shape[0], -1).square().sum(1).cpu()
        if config.use_gradient:
            batch = torch.as_tensor(QScheme.batch)
            self.scales[batch] = self.scales[batch] * 0.5 + norms * 0.5
        else:
            self.scales = norms.mean().reshape(1)
