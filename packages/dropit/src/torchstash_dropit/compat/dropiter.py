"""``DropITer``: DropIT's per-layer selector, for code that builds one by hand.

``select(x, ctx)`` returns what a layer keeps of ``x`` for its weight gradient and records on
``ctx`` what ``pad(kept, ctx)`` needs to rebuild a tensor of ``x``'s size, the dropped
entries zero: flattened, as DropIT's did (the caller reshapes). ``transfer`` is
:func:`~.convert.to_dropit`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from torchstash.errors import OptionError

from .convert import STRATEGIES, to_dropit


class DropITer:
    """``DropITer(strategy, gamma)``: ``gamma`` is the share dropped, ``reserve`` the share
    kept; ``autocast`` is set by whoever builds it (DropIT's ``to_dropit`` did)."""

    def __init__(self, strategy: str, gamma: float) -> None:
        if strategy not in STRATEGIES:
            raise OptionError(
                f"DropITer: strategy={strategy!r} is not one of DropIT's: {', '.join(STRATEGIES)}"
            )
        self.strategy = strategy
        self.gamma = gamma
        self.reserve = 1 - gamma
        self.autocast = False
        self.select = getattr(self, f"select_{strategy}")
        self.pad = getattr(self, f"pad_{strategy}")

    def _ctx(self, ctx: Any) -> Any:
        return SimpleNamespace() if ctx is None else ctx

    def select_mink(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        """The ``int(numel * reserve)`` largest magnitudes of the whole tensor."""
        ctx = self._ctx(ctx)
        flat = x.reshape(-1)
        k = int(flat.numel() * self.reserve)
        idxs = flat.abs().topk(k, sorted=False).indices
        ctx.idxs, ctx.numel = idxs.to(torch.int32), flat.numel()
        return flat[idxs]

    def pad_mink(self, x: torch.Tensor, ctx: Any) -> torch.Tensor:
        """``x`` (the kept values) scattered back into zeros of the original size."""
        idxs = ctx.idxs.to(device=x.device, dtype=torch.int64)
        del ctx.idxs
        return torch.zeros(ctx.numel, dtype=x.dtype, device=x.device).scatter_(0, idxs, x)

    def select_mink_cpuidx(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        """As ``select_mink``, the positions kept in host memory."""
        ctx = self._ctx(ctx)
        kept = self.select_mink(x, ctx)
        ctx.idxs = ctx.idxs.to("cpu", torch.int64)
        return kept

    def pad_mink_cpuidx(self, x: torch.Tensor, ctx: Any) -> torch.Tensor:
        return self.pad_mink(x, ctx)

    def select_vrandom(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        """A random ``reserve`` share of the entries, the rest zero, scaled by ``1 / reserve``
        so the weight gradient stays unbiased; dense, as DropIT's (it saves nothing)."""
        keep = torch.rand_like(x, dtype=torch.float32) < self.reserve
        scale = 1.0 / self.reserve if self.reserve > 0 else 0.0
        return torch.where(keep, x * scale, 0).reshape(-1)

    def pad_vrandom(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return x

    @staticmethod
    def transfer(model: nn.Module, strategy: str, gamma: float, autocast: bool) -> nn.Module:
        return to_dropit(model, strategy, gamma, autocast)
