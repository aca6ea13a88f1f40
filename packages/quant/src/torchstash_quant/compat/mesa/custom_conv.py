"""Mesa's ``custom_conv`` (``mesa.cc``): its ``Conv2d``."""

from __future__ import annotations

from .layers import Conv2d

__all__ = ["Conv2d"]
