"""Mesa's ``custom_quant``: the quantizer its layers mix in, for code that builds its own.

A layer ``class MyOp(nn.Module, custom_quant.Quant)`` gets Mesa's per-group running range
(``clip_val``, ``shift``: EMA of each group's range and minimum, exact at the first step) and
``Quant.forward(ctx, x, ...)`` / ``Quant.restore(ctx)`` to store ``x`` in 8-bit codes on an
autograd ``ctx`` and get it back, as Mesa's custom autograd Functions did. In plain PyTorch, on
any device (Mesa's needed its CUDA extension). Fixed on purpose: codes past the running range
are clamped to 0..255 (Mesa's wrapped modulo 256 and came back as garbage), and a NaN or Inf is
kept (Mesa's turned it into a code). ``Policy`` files reach these layers through
``policy.deploy_on_init`` and :meth:`Quant.update_quantization_parameter`, as in Mesa.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: the attributes :meth:`Quant.__str__` shows when the layer is enabled
ITEMS = ("clip_val", "level", "stable", "ema_decay", "quant_groups")


def pack_group(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``x`` as ``(groups, -1)``, one quantization group per row: the channels of a
    ``(B, N, C)`` or ``(B, C)`` tensor in ``groups`` contiguous chunks, the heads (dim 1) of a
    4-D ``(B, H, N, D)`` tensor (or a conv's channels) merged or split into ``groups``."""
    if x.dim() in (2, 3):
        c = x.shape[-1]
        if c % groups:
            raise ValueError(f"pack_group: {c} channels do not split into {groups} groups")
        return x.reshape(-1, groups, c // groups).transpose(0, 1).reshape(groups, -1)
    if x.dim() == 4:
        return x.transpose(0, 1).reshape(groups, -1)
    raise ValueError(f"pack_group: takes 2-D, 3-D or 4-D tensors, got {x.dim()}-D")


def depack_group(
    x: torch.Tensor, groups: int, input_shape: torch.Size | tuple[int, ...]
) -> torch.Tensor:
    """:func:`pack_group` undone: a contiguous tensor of ``input_shape``."""
    shape = torch.Size(input_shape)
    if len(shape) in (2, 3):
        c = shape[-1]
        rows = x.reshape(groups, -1, c // groups).transpose(0, 1)
        return rows.reshape(shape).contiguous()
    if len(shape) == 4:
        return x.reshape(shape[1], shape[0], *shape[2:]).transpose(0, 1).contiguous()
    raise ValueError(f"depack_group: takes 2-D, 3-D or 4-D shapes, got {tuple(shape)}")


def update_clip_val_shift(
    input: torch.Tensor,
    clip_val: torch.Tensor,
    shift: torch.Tensor,
    iteration: torch.Tensor,
    ema_decay: float,
    level: int,
) -> None:
    """Each group's (row's) range and minimum into ``clip_val`` and ``shift``: exact at the
    first call, then an EMA with ``ema_decay``; ``iteration`` counts the calls. Non-finite
    values are left out of the statistics."""
    x = input.detach().float()
    finite = x.isfinite()
    hi = torch.where(finite, x, -torch.inf).amax(dim=1)
    lo = torch.where(finite, x, torch.inf).amin(dim=1)
    none = ~finite.any(dim=1)
    hi, lo = torch.where(none, 0.0, hi), torch.where(none, 0.0, lo)
    with torch.no_grad():
        if int(iteration.item()) == 0:
            clip_val.data = (hi - lo).to(clip_val.dtype)
            shift.data = lo.to(shift.dtype)
        else:
            clip_val.sub_((1 - ema_decay) * (clip_val - (hi - lo).to(clip_val.dtype)))
            shift.sub_((1 - ema_decay) * (shift - lo.to(shift.dtype)))
        iteration.add_(1)


class Quant:
    """Mesa's quantizer state, mixed into an ``nn.Module``: ``enable``, ``level`` (256: 8
    bits), ``ema_decay``, ``quant_groups``, ``tag`` and ``index`` (set by the policy), and the
    running ``clip_val``/``shift`` (Parameters without gradient, in ``state_dict`` as in
    Mesa's checkpoints)."""

    def __init__(
        self,
        args: Any = None,
        logger: Any = None,
        enable: bool = False,
        tag: str = "fm",
        quant_groups: int | tuple[int, ...] = 1,
        mesa: bool = False,
    ) -> None:
        if not isinstance(self, nn.Module):
            raise TypeError("custom_quant.Quant is mixed into an nn.Module subclass")
        if isinstance(quant_groups, (tuple, list)):
            quant_groups = quant_groups[0]
        self.enable = bool(enable or mesa)
        self.iteration = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.quant_groups = int(quant_groups)
        self.level = 256
        self.tag = tag
        self.index = -1
        self.ema_decay = 0.9
        self.stable = -1
        self.clip_val = nn.Parameter(torch.ones(self.quant_groups), requires_grad=False)
        self.shift = nn.Parameter(torch.zeros(self.quant_groups), requires_grad=False)
        self.args = args
        self.string = "ms."
        self.logger = logger if logger is not None else getattr(args, "logger", None)
        self.verbose = self.logger.info if self.logger is not None else print
        self.items = list(ITEMS)
        if args is not None and getattr(args, "fm_bit", None) is not None:
            self.level = int(2**args.fm_bit)
        if args is not None and getattr(args, "fm_enable", None) is not None:
            self.enable = bool(args.fm_enable)

    def __str__(self) -> str:
        text = f"{self.string}{nn.Module.__repr__(self)}-index({self.index})-tag({self.tag})"
        if self.enable:
            for item in self.items:
                value = getattr(self, item, None)
                if isinstance(value, torch.Tensor):
                    if value.numel() > 1:
                        continue
                    value = value.item()
                if value is not None:
                    text += f"-{item}({value})"
        return text

    def update_quantization_parameter(self, **parameters: Any) -> dict[str, Any] | None:
        """What Mesa's policy sends a layer: ``index=`` (an int, or a dict keyed by tag) sets
        its index; ``by_index`` (``'all'``, a list or a space-separated string) and
        ``by_tag`` select the layers the other keys apply to, each converted to the type of
        the attribute it sets (keys the layer has not are ignored, as in Mesa)."""
        index = parameters.get("index")
        if isinstance(index, dict):
            index = index.get(self.tag)
        if isinstance(index, int) and index != self.index:
            self.index = index
            self.verbose(f"update {self.tag}_index {index!r}")
        if "by_index" in parameters and _selected(self, parameters):
            for key, value in parameters.items():
                if key in ("by_index", "by_tag", "index") or not hasattr(self, key):
                    continue
                self._set(key, value)
        self.clip_val.requires_grad = self.shift.requires_grad = False
        return {} if self.enable else None

    def _set(self, key: str, value: Any) -> None:
        current = getattr(self, key)
        if isinstance(current, torch.Tensor):
            with torch.no_grad():
                current.fill_(float(value))
        elif isinstance(current, bool):
            setattr(self, key, value not in ("False", "false", False))
        elif isinstance(current, int):
            setattr(self, key, int(value))
        elif isinstance(current, float):
            setattr(self, key, float(value))
        elif isinstance(current, str):
            text = str(value).strip("'\"")
            text = {"same": str(self.index), "last": str(self.index - 1)}.get(text, text)
            setattr(self, key, text)
        else:
            setattr(self, key, value)
        self.verbose(f"update {self.tag}_{key} to {getattr(self, key)} for index {self.index}")

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        clip_val: torch.Tensor,
        level: int,
        iteration: torch.Tensor,
        ema_decay: float,
        quant_groups: int,
        shift: torch.Tensor,
        identifier: str = "_",
    ) -> None:
        """Code ``x`` in 8 bits per element on ``ctx`` (stochastic rounding against the
        group's running range, updated from ``x`` first)."""
        packed = pack_group(x.detach(), quant_groups)
        update_clip_val_shift(packed, clip_val, shift, iteration, ema_decay, level)
        scale = (level - 1) / clip_val.detach().float().abs().clamp_min(1e-12)
        lo = shift.detach().float()
        noise = torch.rand(packed.shape, device=x.device)
        codes = torch.floor((packed.float() - lo[:, None]) * scale[:, None] + noise)
        finite = packed.isfinite()
        codes = torch.where(finite, codes, 0).clamp_(0, 255).to(torch.uint8)
        exact = torch.where(finite, 0, packed) if not bool(finite.all()) else None
        setattr(ctx, f"input{identifier}", codes)
        setattr(ctx, f"nonfinite{identifier}", exact)
        setattr(ctx, f"scale{identifier}", scale)
        setattr(ctx, f"shift{identifier}", lo)
        setattr(ctx, f"input_shape{identifier}", x.shape)
        setattr(ctx, f"input_type{identifier}", x.dtype)
        setattr(ctx, f"groups{identifier}", quant_groups)

    @staticmethod
    def restore(ctx: Any, identifier: str = "_") -> torch.Tensor:
        """The tensor :meth:`forward` coded on ``ctx``, decoded (and dropped from ``ctx``)."""
        names = ("input", "nonfinite", "scale", "shift", "input_shape", "input_type", "groups")
        codes, exact, scale, lo, shape, dtype, groups = (
            getattr(ctx, f"{n}{identifier}") for n in names
        )
        values = codes.float() / scale[:, None] + lo[:, None]
        if exact is not None:
            values = torch.where(exact.isfinite(), values, exact.float())
        for n in names:
            delattr(ctx, f"{n}{identifier}")
        return depack_group(values, groups, shape).to(dtype)

    @staticmethod
    def backward(ctx: Any, grad_input: torch.Tensor, identifier: str = "_") -> None:
        raise NotImplementedError("custom_quant.Quant.backward: not supported (as in Mesa)")


def _selected(layer: Quant, parameters: dict[str, Any]) -> bool:
    by_index = parameters["by_index"]
    if by_index != "all":
        if isinstance(by_index, str):
            by_index = by_index.split()
        if layer.index not in {int(i) for i in by_index}:
            return False
    by_tag = parameters.get("by_tag")
    return by_tag is None or layer.tag in by_tag


class quantization(nn.Module, Quant):
    """A bare holder of quantizer state (Mesa's Softmax and MatMul keep two)."""

    def __init__(
        self,
        args: Any = None,
        logger: Any = None,
        tag: str = "fm",
        quant_groups: int | None = None,
        mesa: bool = False,
    ) -> None:
        nn.Module.__init__(self)
        Quant.__init__(
            self, args=args, logger=logger, tag=tag, quant_groups=quant_groups or 1, mesa=mesa
        )

    def __repr__(self) -> str:
        return self.__str__()


__all__ = ["Quant", "depack_group", "pack_group", "quantization", "update_clip_val_shift"]
