"""ActNN's ``QBNScheme``: :class:`~.qscheme.QScheme` for BatchNorm layers, with its own
registry; it follows the scheme of the conv before it (``prev_linear``)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from .conf import config
from .qscheme import QScheme


class QBNScheme(QScheme):
    layers: ClassVar[list[QScheme]] = []

    def __init__(self, group: int = 0) -> None:  # ActNN's did not call QScheme.__init__
        self.initial_bits = config.initial_bits
        bits = config.activation_compression_bits
        self.bits = bits[min(group, len(bits) - 1)]
        self.prev_linear: Any = QScheme.layers[-1] if QScheme.layers else None
        self.group = group
        self.scales = torch.tensor([0.0])
        self.C: Any = None
        self.dim: Any = None
        QBNScheme.layers.append(self)
