"""Outputs recomputed from a stored input: a GELU's output is its input, one op later.

A transformer saves most activations twice over: a LayerNorm keeps its input and the next
projection keeps the LayerNorm's output; a GELU keeps its input and the next Linear keeps the
GELU's output. Both outputs are a cheap function of the input already stored. When the
strategy stores that input compressed anyway and says its code is fine to recompute from
(``derivable(x, site)`` on the compressor), the engine keeps a later save of the output as a
:class:`Recipe` over the input's entry: no bytes of its own, the op applied again to the
restored input in backward. The bytes saved can buy the input a wider code, so the output
comes back closer to exact than its own code of the same total size would give.

Attention's output is recomputed the same way: ``attn @ v`` from the two operands the matmul
saved, carried through the ``transpose``/``reshape`` copy that feeds the output projection
(:data:`~torchstash.opnames.LAYOUT_OPS`: a recipe for an op's input is one for its output, one step longer); so
is a training BatchNorm's output, carried through the (in-place) ReLU after it, and the
attention map itself: ``q @ k.T`` carried through the scale, the mask, the softmax and the
casts (:data:`~torchstash.opnames.POINTWISE_OPS`, replayed by :class:`Replay` with the call's other arguments
held as they were). A fused ``scaled_dot_product_attention``'s output and log-sum-exp are
replayed from its saved ``q``, ``k``, ``v`` by the same kernel (:class:`FusedAttention`,
:data:`FUSED_ATTENTION`). Under autocast the engine also matches a projection's bf16 copy of
such an output, read from autograd's graph, as the recipe followed by the same cast.

Only for ops whose output is a pure function of the inputs, arguments and the statistics the
op saved (:data:`DERIVE_OPS`); anything else saved is stored as usual.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from .opmark import AutocastState
from .optrack import autocast_state
from .replaystep import Replay, under_autocast
from .site import position

#: Fused attention: it saves its own output (for backward), which the projection after it
#: saves again as a transposed copy; that copy is the saved output, a layout step later.
SDPA = "scaled_dot_product_attention"
#: Ops whose output the engine can recompute from what they saved.
DERIVE_OPS = frozenset({"gelu", "silu", "hardswish", "layer_norm", "batch_norm", "matmul", SDPA})
#: Functions whose result is the plain product of the two operands they save (no scaling,
#: no bias, no sum over a third operand): a matmul recipe is offered for these only.
MATMUL_FUNCS = frozenset({"matmul", "__matmul__", "bmm", "mm"})


def _argument(args: Sequence[Any], kwargs: dict[str, Any], name: str, pos: int) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[pos] if len(args) > pos else None


@dataclass
class Recipe:
    """How to recompute one call's output: the op, its non-input arguments, the statistics it
    saved (a LayerNorm's mean and reciprocal std, in save order), the output's dtype, and the
    layout steps applied since (a ``transpose`` then a ``reshape``)."""

    op: str
    arguments: dict[str, Any]
    stats: list[torch.Tensor] = field(default_factory=list)
    dtype: torch.dtype | None = None
    #: False when a statistic was stored as a code: the output is then stored as usual
    usable: bool = True
    #: how many saved operands it is computed from (a matmul: two)
    arity: int = 1
    #: how many statistics the op must have saved (a LayerNorm's or BatchNorm's: two)
    stats_needed: int = 0
    #: the op's output shape (a matmul's operands are saved folded to 3-d: ``attn @ v`` on
    #: (B, H, N, N) and (B, H, N, D) saves (B*H, N, N) and (B*H, N, D))
    shape: torch.Size | None = None
    steps: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = ()
    #: autocast as it was when the op ran (its replay runs under the same)
    autocast: AutocastState = field(default_factory=autocast_state)

    def __call__(self, *operands: torch.Tensor) -> torch.Tensor:
        with under_autocast(self.autocast, operands[0].device.type):
            out = _RECOMPUTE[self.op](self, *operands)
        if self.shape is not None:
            out = out.reshape(self.shape)
        if self.dtype is not None:
            out = out.to(self.dtype)
        # a fresh output no one else holds: an in-place step right after it (a BatchNorm's
        # in-place ReLU) runs in place, as in the forward, sparing a pass and a tensor
        owned = self.op in _FRESH
        for step in self.steps:
            if isinstance(step, Replay):
                out, owned = step.run(out, owned)
            else:
                out, owned = step(out), False
        return out

    def with_stats(self, stats: list[torch.Tensor]) -> Recipe:
        """This recipe with one step's statistics: a shallow copy (``dataclasses.replace``
        costs a few microseconds per replayed save), or the recipe itself when it has none."""
        if not stats:
            return self
        new = object.__new__(Recipe)
        new.__dict__.update(self.__dict__)
        new.stats = stats
        return new

    def then(self, step: Callable[[torch.Tensor], torch.Tensor]) -> Recipe:
        """This recipe followed by a layout step (the statistics are shared, not copied)."""
        return replace(self, steps=(*self.steps, step))

    def held(self) -> list[torch.Tensor]:
        """The tensors its steps keep alive besides the operands (a mask, a scale)."""
        return [t for step in self.steps if isinstance(step, Replay) for t in step.constants]


def matmul_order(
    shapes: Sequence[tuple[int, ...]], roles: Sequence[str], result: tuple[int, ...]
) -> tuple[int, int] | None:
    """Which of the two saved operands is the left one, from their shapes (the roles settle
    square operands: ``input`` is the call's left argument, ``arg1`` its right), or None when
    their product is not the result."""
    if len(shapes) != 2 or any(len(s) < 2 for s in shapes):
        return None
    fits = [
        (a, b)
        for a, b in ((0, 1), (1, 0))
        if shapes[a][-1] == shapes[b][-2] and _product_numel(shapes[a], shapes[b]) == _numel(result)
    ]
    if len(fits) == 2:  # square operands: the roles say which is which
        if roles[0] == "input" or roles[1] == "arg1":
            return (0, 1)
        return (1, 0)  # or autograd's order: it saves the right operand (mat2) first
    return fits[0] if fits else None


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _product_numel(a: Sequence[int], b: Sequence[int]) -> int:
    batch = _broadcast(a[:-2], b[:-2])
    return -1 if batch is None else _numel(batch) * a[-2] * b[-1]


def _broadcast(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...] | None:
    """``torch.broadcast_shapes(a, b)``, None where it raises: a few tuple steps where torch's
    (its reference implementation, in Python) took 30 us a call, several times a step."""
    width = max(len(a), len(b))
    out = []
    for x, y in zip((1,) * (width - len(a)) + tuple(a), (1,) * (width - len(b)) + tuple(b)):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None
    return tuple(out)


def save_kind(op: str, role: str, t: torch.Tensor, args: Sequence[Any]) -> str:
    """What a tensor a :data:`DERIVE_OPS` call saves is to its recipe: ``"source"`` (an
    operand the output is recomputed from), ``"stat"`` (a statistic the recipe needs, saved
    after its inputs: a LayerNorm's mean and rstd), ``"output"`` (a fused attention's output
    or log-sum-exp, recomputed from its ``q``, ``k``, ``v``) or ``""`` (not needed)."""
    if op == "matmul":
        return "source"
    if op == SDPA:
        return _fused_attention_kind(role, t, args)
    return "source" if role == "input" else "stat"


def _fused_attention_kind(role: str, t: torch.Tensor, args: Sequence[Any]) -> str:
    """``q``, ``k``, ``v`` (the call's first three arguments, saved as they are) are sources;
    a saved tensor shaped like the output (``q``'s batch and rows, ``v``'s width) or like its
    log-sum-exp (``q``'s batch and rows) is an output; the rest (a mask) neither."""
    if position(t, args) is not None:  # q, k or v
        return "source"
    q, v = (args[0], args[2]) if len(args) > 2 else (None, None)
    if role != "output" or not isinstance(q, torch.Tensor) or not isinstance(v, torch.Tensor):
        return ""
    rows = tuple(q.shape[:-1])
    return "output" if tuple(t.shape) in (rows, (*rows, v.shape[-1])) else ""


def recipe(op: str, args: Sequence[Any], kwargs: dict[str, Any], func: str = "") -> Recipe | None:
    """The recipe for the running call of ``op`` (raw function name ``func``), or None when
    its output cannot be rebuilt from its saved inputs alone (a LayerNorm without its
    statistics, a matmul that adds a bias)."""
    if op == "matmul":
        return Recipe(op, {}, arity=2) if func in MATMUL_FUNCS else None
    if op == SDPA:
        arguments = {
            name: _argument(args, kwargs, name, pos)
            for name, pos in (
                ("attn_mask", 3),
                ("dropout_p", 4),
                ("is_causal", 5),
                ("scale", 6),
                ("enable_gqa", 7),
            )
        }
        return Recipe(op, arguments, arity=3)
    if op == "gelu":
        approximate = _argument(args, kwargs, "approximate", 1) or "none"
        return Recipe(op, {"approximate": str(approximate)})
    if op in ("silu", "hardswish"):  # in place too: the copy of the input it saves is the
        return Recipe(op, {})  # source (replayed out of place, see Replay)
    if op == "layer_norm":
        weight = _argument(args, kwargs, "weight", 2)
        bias = _argument(args, kwargs, "bias", 3)
        return Recipe(op, {"weight": weight, "bias": bias}, stats_needed=2)
    if op == "batch_norm" and func == "batch_norm":
        if not _argument(args, kwargs, "training", 5):
            return None  # eval: normalized by the running statistics, which may change
        weight = _argument(args, kwargs, "weight", 3)
        bias = _argument(args, kwargs, "bias", 4)
        return Recipe(op, {"weight": weight, "bias": bias}, stats_needed=2)
    return None


def _gelu(r: Recipe, x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate=r.arguments["approximate"])


def _silu(r: Recipe, x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


def _hardswish(r: Recipe, x: torch.Tensor) -> torch.Tensor:
    return F.hardswish(x)


def _normalized(r: Recipe, x: torch.Tensor, shape: list[int] | None = None) -> torch.Tensor:
    """``(x - mean) * scale * weight + bias`` with the exact statistics the forward saved
    (``scale``: rstd or invstd), viewed as ``shape`` where they are per channel, so the
    output agrees with what the op's own backward sees of the same input."""
    if len(r.stats) != 2:
        raise RuntimeError(
            f"{r.op} recipe: expected the two statistics the op saved, got {len(r.stats)} tensors"
        )

    def fit(t: torch.Tensor) -> torch.Tensor:
        return t if shape is None else t.view(shape)

    mean, scale = r.stats
    y = x.to(scale.dtype) - fit(mean)  # a fresh tensor: the steps below may run in place
    y = _times(y, fit(scale))
    weight, bias = r.arguments["weight"], r.arguments["bias"]
    if weight is not None:
        y = _times(y, fit(weight.detach()))
    if bias is not None:
        b = fit(bias.detach())
        y = y.add_(b) if _fits_in(y, b) else y + b
    return y


def _fits_in(y: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``y op t`` has ``y``'s shape and dtype, so ``y.op_(t)`` gives the same values
    without a new tensor (a normalization's recipe: three full-size allocations fewer)."""
    return (
        _broadcast(y.shape, t.shape) == tuple(y.shape)
        and torch.promote_types(y.dtype, t.dtype) == y.dtype
        and not (y.requires_grad or t.requires_grad)  # autograd would need y's old values
    )


def _times(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return y.mul_(t) if _fits_in(y, t) else y * t


def _layer_norm(r: Recipe, x: torch.Tensor) -> torch.Tensor:
    return _normalized(r, x)


def _batch_norm(r: Recipe, x: torch.Tensor) -> torch.Tensor:
    """Per channel (dim 1), with the batch mean and invstd the forward saved, in one pass:
    ``x * a + c`` with ``a = invstd * weight`` and ``c = bias - mean * a`` per channel (as
    ATen's CPU kernel computes the forward), where :func:`_normalized` takes four passes over
    the whole tensor (a small CNN's step spent a millisecond in them)."""
    if len(r.stats) != 2:
        return _normalized(r, x)  # says what is missing
    mean, scale = r.stats
    weight, bias = r.arguments["weight"], r.arguments["bias"]
    a = scale if weight is None else scale * weight.detach().to(scale.dtype)
    c = -mean * a if bias is None else bias.detach().to(scale.dtype) - mean * a
    # ATen's inference BatchNorm with weight a, bias c, mean 0 and variance 1 (eps 0) is
    # exactly x * a + c, one vectorized pass per channel: four times faster on CPU than a
    # broadcast addcmul; cuDNN is left out (it refuses eps 0)
    zero = torch.zeros_like(a)
    return torch.batch_norm(
        x.to(scale.dtype), a, c, zero, torch.ones_like(a), False, 0.0, 0.0, False
    )


def _matmul(r: Recipe, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


def _saved_output(r: Recipe, out: torch.Tensor) -> torch.Tensor:
    return out


class FusedAttention:
    """One fused attention call replayed in backward: its output and log-sum-exp from the
    restored ``q``, ``k``, ``v``, with the call's own arguments (its mask held, with its
    version checked). Both come from one replay, kept until each was taken."""

    def __init__(self, kernel: Callable[..., tuple[torch.Tensor, ...]], arguments: dict[str, Any]):
        self.kernel = kernel
        mask = arguments.get("attn_mask")
        self.mask = mask.detach() if isinstance(mask, torch.Tensor) else None
        self.mask_version = self.mask._version if self.mask is not None else 0
        self.dropout_p = float(arguments.get("dropout_p") or 0.0)
        self.is_causal = bool(arguments.get("is_causal"))
        self.scale = arguments.get("scale")
        self._results: tuple[torch.Tensor, ...] | None = None
        self._left: set[int] = set()

    def output(self, which: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._results is None:
            if self.mask is not None and self.mask._version != self.mask_version:
                raise RuntimeError(
                    "torchstash recomputes a scaled_dot_product_attention's output in backward, "
                    f"and its {tuple(self.mask.shape)} attn_mask was modified by an inplace "
                    f"operation after the forward (version {self.mask._version}, expected "
                    f"{self.mask_version}). Leave the mask unchanged until backward."
                )
            self._results = self.kernel(
                q, k, v, self.dropout_p, self.is_causal, attn_mask=self.mask, scale=self.scale
            )
            self._left = {0, 1}
        out = self._results[which]
        self._left.discard(which)
        if not self._left:
            self._results = None
        return out


def _fused_output(r: Recipe, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    replay = r.arguments["replay"]
    assert isinstance(replay, FusedAttention)
    return replay.output(int(r.arguments["which"]), q, k, v)


class AttentionKernel(NamedTuple):
    """A fused attention kernel the engine replays: the device it runs on, ``replay(q, k, v,
    dropout_p, is_causal, attn_mask=, scale=) -> (output, logsumexp, ...)``, and whether the
    replay takes the call's ``attn_mask`` as the user gave it (the CUDA kernels get a mask
    only after torch converted and padded it: calls with one keep their saves exact)."""

    device: str
    replay: Callable[..., tuple[torch.Tensor, ...]]
    takes_mask: bool = True


def _cpu_flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """The CPU kernel as ``scaled_dot_product_attention`` calls it: a boolean mask (True:
    attend) becomes the additive one it passes (0 where True, -inf where False)."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        additive = torch.zeros_like(attn_mask, dtype=q.dtype)
        attn_mask = additive.masked_fill_(attn_mask.logical_not(), float("-inf"))
    out: tuple[torch.Tensor, ...] = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out


def _without_mask(
    call: Callable[..., tuple[torch.Tensor, ...]],
) -> Callable[..., tuple[torch.Tensor, ...]]:
    """A CUDA kernel's replay from ``call(q, k, v, dropout_p, is_causal, scale)``: these get
    no mask as the user gave it (:attr:`AttentionKernel.takes_mask`)."""

    def replay(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dropout_p: float,
        is_causal: bool,
        attn_mask: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> tuple[torch.Tensor, ...]:
        assert attn_mask is None
        return tuple(call(q, k, v, dropout_p, is_causal, scale))

    return replay


_ATEN = torch.ops.aten


#: Fused attention kernels whose output and log-sum-exp the engine recomputes, by the name
#: of the backward node the call made (read from the output's graph once it returned). Only
#: kernels checked against stock: others keep their saves exact, and so does a call whose
#: log-sum-exp is not shaped like the output's rows (memory-efficient attention pads it to a
#: multiple of 32 rows, cuDNN's has a trailing 1): the engine then finds no second output
#: to recompute, and turns the call's codes back into the exact tensors.
FUSED_ATTENTION: dict[str, AttentionKernel] = {
    "ScaledDotProductFlashAttentionForCpuBackward0": AttentionKernel("cpu", _cpu_flash),
    "ScaledDotProductFlashAttentionBackward0": AttentionKernel(
        "cuda",
        _without_mask(
            lambda q, k, v, p, causal, scale: _ATEN._scaled_dot_product_flash_attention(
                q, k, v, p, causal, False, scale=scale
            )
        ),
        takes_mask=False,
    ),
    "ScaledDotProductEfficientAttentionBackward0": AttentionKernel(
        "cuda",
        _without_mask(
            lambda q, k, v, p, causal, scale: _ATEN._scaled_dot_product_efficient_attention(
                q, k, v, None, True, p, causal, scale=scale
            )
        ),
        takes_mask=False,
    ),
    "ScaledDotProductCudnnAttentionBackward0": AttentionKernel(
        "cuda",
        _without_mask(
            lambda q, k, v, p, causal, scale: _ATEN._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, p, causal, False, scale=scale
            )
        ),
        takes_mask=False,
    ),
}


def may_replay_attention(device: torch.device, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a fused attention call on ``device`` with these arguments can have its output
    recomputed: a kernel for the device in :data:`FUSED_ATTENTION` that takes the call's
    mask, and no dropout. Checked before its q, k, v are coded (the kernel itself is known
    only once it returned)."""
    if _argument(args, kwargs, "dropout_p", 4):
        return False
    masked = _argument(args, kwargs, "attn_mask", 3) is not None
    return any(
        kernel.device == device.type and (kernel.takes_mask or not masked)
        for kernel in FUSED_ATTENTION.values()
    )


def fused_attention(result: torch.Tensor, r: Recipe) -> FusedAttention | None:
    """A replay of the fused attention call that returned ``result``, or None when its kernel
    is not in :data:`FUSED_ATTENTION` (or cannot take its mask) or it drops (dropout's random
    mask is not replayed)."""
    node = result.grad_fn
    found = FUSED_ATTENTION.get(node.name()) if node is not None else None
    if found is None or found.device != result.device.type or r.arguments.get("dropout_p"):
        return None
    if r.arguments.get("attn_mask") is not None and not found.takes_mask:
        return None
    return FusedAttention(found.replay, r.arguments)


#: a fused attention's output or log-sum-exp replayed (see :class:`FusedAttention`)
FUSED = "fused_attention"

#: the recipes whose output is a new tensor (not an operand, not a cached replay's result)
_FRESH = frozenset({"gelu", "silu", "hardswish", "layer_norm", "batch_norm", "matmul"})

_RECOMPUTE: dict[str, Callable[..., torch.Tensor]] = {
    SDPA: _saved_output,
    FUSED: _fused_output,
    "gelu": _gelu,
    "silu": _silu,
    "hardswish": _hardswish,
    "layer_norm": _layer_norm,
    "batch_norm": _batch_norm,
    "matmul": _matmul,
}
