"""Op-aware savings on top of any value codec: sign bits for ReLUs, bits for masks.

Every ``quant.*`` strategy is an :class:`OpAware` around its value codec, so a ReLU's result
costs one exact bit whatever the bit width, and a dropout mask one bit (bool masks: instead
of a byte; the scaled float mask CPU dropout saves: instead of four bytes), and a 2-d max
pool's indices 4 bits or fewer (the argmax's position in its window: :mod:`.pool`) instead
of 64.
Inputs of normalization ops (LayerNorm, GroupNorm, RMSNorm, BatchNorm): their backward
normalizes the saved input again, so a group must not mix two rows' scales. A value codec
that takes a per-tensor ``group_size`` gets groups aligned to the normalized rows
(:mod:`.rows`; a BatchNorm input on maps too small for that is stored channel-major, a
group per channel over the batch); where none fits the ``norms`` codec (``norm_bits``)
takes the tensor instead. Other tensors: groups inside one innermost row where that costs
at most twice the scales.
Inputs of GELU and SiLU: with ``deriv_bits`` set, a code of their derivative
(:mod:`.derivs`) instead of the values.
Attention: the map is never stored. The engine recomputes it in backward from ``q`` and ``k``
(written out) or replays a fused attention from ``q``, ``k``, ``v``; those operands of the
scores are kept at :data:`SCORES_BITS`, rounded to nearest, whatever the width. ``v`` (and a
map after a dropout that drops, read only by its ``@ v``): with ``attn_bits`` set, at that
width instead of the codec's (measured in the demo at 2 bits: attention cost more of the
final loss than everything else together).
Inputs that stand in for outputs (``derive``): a LayerNorm's input (at ``norm_bits``) and a
GELU's or SiLU's kept as values (at ``act_bits``) are ``derivable``, so the engine recomputes
the op's output from them when the next op saves it (:mod:`torchstash.derive`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

import torch

from torchstash.compressor import (
    AtSite,
    BaseCompressor,
    Compressor,
    Encoder,
    graph_refusal,
    replays_at,
    replays_next,
)
from torchstash.packed import Packed
from torchstash.site import Site

from ._dtypes import dtype_reasons
from .centered import MIN_CENTERED_ROW, center_rows, uncenter
from .derivs import ACT_OPS, DERIV_OPS, DerivCoder, unpack_derivative
from .derivs import CODEC as DERIV_CODEC
from .groupcode import GroupCode, GroupCodec
from .groupwise import GROUP, GROUP_ROWS, GroupQuantizer, decode_group, decode_rows
from .masks import (
    DROPOUT_OPS,
    SIGN_OPS,
    pack_bool,
    pack_scaled_mask,
    pack_signs,
    unpack_bool,
    unpack_scaled_mask,
    unpack_signs,
)
from .pool import CODEC as POOL_CODEC
from .pool import POOL_FUNCS, pack_pool_positions, pool_geometry, unpack_pool_positions
from .rows import aligned_group_size, channel_major_run, normalized_run, static_size

#: Ops whose backward amplifies an error in their saved input (it is normalized again).
#: Codes that hold what the op's backward reads exactly, in any float type (a ReLU's signs,
#: a dropout's mask, max-pool positions): float64 tensors take them too.
EXACT_KINDS = frozenset({"bool", "pool", "sign", "dropmask"})
NORM_OPS = frozenset({"layer_norm", "group_norm", "rms_norm", "batch_norm"})
#: Ops whose saved tensors are attention's when no operand is a Parameter (see attn_bits).
ATTENTION_OPS = frozenset({"matmul", "softmax"})
SDPA = "scaled_dot_product_attention"
#: What a fused attention saves besides q, k, v (a mask) is kept as it is.
SDPA_REASON = (
    f"{SDPA}'s saves other than q, k, v (a mask) are kept exact; its output and log-sum-exp "
    "are recomputed from them in backward, or kept exact"
)

#: How a ReLU-like op's saved tensor is recorded: its sign bits, by the core's shared codec
SIGN_CODEC = "quant.sign"


def _as_is(x: torch.Tensor) -> torch.Tensor:
    return x


def _pool_encoder(site: Site) -> Encoder:
    """A max pool's indices as in-window positions (:mod:`.pool`), where its geometry is
    known; its code checks that the positions give the indices back (else: as they are)."""
    geometry = site.recalled or pool_geometry(site.opcall.args, dict(site.opcall.kwargs))
    if geometry is None:
        return _as_is

    def encode(x: torch.Tensor) -> Packed | torch.Tensor:
        packed = pack_pool_positions(x, geometry)
        return x if packed is None else packed

    return encode


#: The exact codes, by the kind of save :meth:`OpAware.variant` finds: each one's encoder at
#: a site.
EXACT_ENCODERS: dict[str, Callable[[Site], Encoder]] = {
    "bool": lambda site: pack_bool,
    "sign": lambda site: functools.partial(pack_signs, codec=SIGN_CODEC),
    "dropmask": lambda site: pack_scaled_mask,
    "pool": _pool_encoder,
}


def _decode_rows(packed: Packed) -> torch.Tensor:
    """A record of rows less their offsets (:func:`~.groupwise.decode_rows`), turned back to
    ``(N, C, ...)`` where it was stored channel-major (a BatchNorm channel per row)."""
    if not packed.meta.get("channel_major"):
        return decode_rows(packed, packed.shape)
    n, c, *rest = packed.shape
    return decode_rows(packed, torch.Size([c, n, *rest])).transpose(0, 1)


#: What decodes each record, by the codec name it carries: what was packed says which code
#: decodes it. A record named otherwise is the value codec's own (Mesa's, fp8's).
DECODERS: dict[str, Callable[[Packed], torch.Tensor]] = {
    GROUP: decode_group,
    GROUP_ROWS: _decode_rows,
    "quant.bool": unpack_bool,
    SIGN_CODEC: unpack_signs,
    "quant.scaled_mask": unpack_scaled_mask,
    DERIV_CODEC: unpack_derivative,
    POOL_CODEC: unpack_pool_positions,
}

#: a record of a normalization input centered here and coded by a codec that does not center
#: (its own name in ``meta["inner"]``): :meth:`OpAware._decompress_centered` decodes it
CENTERED = "quant.centered"


class ChannelMajor:
    """A BatchNorm input's code taken as ``(C, N, ...)``: on small maps a channel over the
    batch is a row long enough to code relative to its offset (:func:`.rows.channel_major_run`)."""

    __slots__ = ("inner",)

    def __init__(self, inner: Encoder) -> None:
        self.inner = inner

    def __call__(self, x: torch.Tensor) -> Packed | torch.Tensor:
        packed = self.inner(x.transpose(0, 1).contiguous())
        if not isinstance(packed, Packed):
            return x
        packed.shape = x.shape
        packed.meta["channel_major"] = True
        return packed


#: Width of the operands of attention's scores (``q @ k.T``). The engine recomputes the
#: attention map from them in backward (:mod:`torchstash.derive`) instead of storing it:
#: a softmax's backward, ``P * (dP - sum(P * dP))``, cancels almost exactly where a row is
#: peaked, so a map coded on its own (rows no longer summing to one, no longer the softmax
#: of anything) gave ``q``'s and ``k``'s weight gradients cosines of 0.0-0.5 against stock's
#: on a GPT trained 150-250 steps, at 4 bits and even at 8 (and trained to +7% over stock's
#: loss at 4 bits); recomputed from 8-bit ``q`` and ``k``, 0.98-0.998. From 4-bit ones the
#: logits' error is exponentiated: cosines 0.1-0.3 again.
SCORES_BITS = 8


def scores_codec(values: Compressor) -> GroupCodec:
    """8-bit codes rounded to nearest, in the value codec's group size and name. Stochastic
    rounding's noise, twice the variance, took ``k``'s weight gradient cosine on an SDPA GPT
    trained 300 steps from 0.99 to 0.69: the logits' error is exponentiated (and unbiased
    codes would not make the softmax of them unbiased anyway)."""
    group_size = getattr(values, "group_size", None) or 256
    return GroupQuantizer(SCORES_BITS, group_size, stochastic=False, name=values.name)


#: Autograd nodes between a softmax and the matmul that reads its result: casts, dropout
#: (a product with the mask on CPU), views.
_MAP_NODES = frozenset(
    {
        "ToCopyBackward0",
        "MulBackward0",
        "NativeDropoutBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ReshapeAliasBackward0",
        "ExpandBackward0",
        "CloneBackward0",
        "TransposeBackward0",
    }
)


def from_softmax(t: object, depth: int = 4) -> bool:
    """Whether autograd made ``t`` from a softmax's result by casts, dropout and views alone
    (read from its graph: no pass over the values)."""
    node = getattr(t, "grad_fn", None)
    for _ in range(depth):
        if node is None:
            return False
        name = node.name()
        if "SoftmaxBackward" in name:
            return True
        if name not in _MAP_NODES or not node.next_functions:
            return False
        node = node.next_functions[0][0]
    return False


#: a compiled graph's roles of an attention kernel's saved tensors, as argument positions
_GRAPH_ATTENTION_ROLES = {"input": 0, "arg1": 1, "arg2": 2, "output": 0}


def attention_part(x: torch.Tensor, site: Site) -> str:
    """What ``x`` is to attention: ``"map"`` (a softmax's output), ``"scores"`` (an operand of
    a matmul of two activations neither of which comes from a softmax: ``q``, ``k.T``),
    ``"values"`` (an operand of one that does: the map, ``v``), or ``""``. A matmul with a
    Parameter is a linear layer in disguise."""
    if site.op == "softmax":  # a log-softmax's output is a loss's, read as values
        if site.role != "output":
            return ""
        return "values" if site.func == "log_softmax" else "map"
    if site.op == SDPA:  # q, k: its map is recomputed from them; v
        position = site.opcall.position(x)
        if position is None and isinstance(site.recalled, int):
            position = site.recalled  # a replayed save: its place in the recorded call
        elif position is None and not site.opcall.args:
            # a compiled graph's save (no call to read): its role among the kernel's tensors;
            # the output the kernel saves stands in for the one eager recomputes from q, k, v
            position = _GRAPH_ATTENTION_ROLES.get(site.role)
        return "" if position is None else ("scores", "scores", "values")[position]
    if site.op != "matmul" or site.opcall.has_parameter:
        return ""
    return "values" if any(from_softmax(a) for a in site.opcall.args) else "scores"


class OpAware(BaseCompressor):
    lossless = False

    def __init__(
        self,
        values: Compressor,
        norms: Compressor | None = None,
        derivs: DerivCoder | None = None,
        attn_bits: int | None = None,
        act_bits: int | None = None,
        derive: bool = False,
        scores: GroupCodec | None = None,
    ) -> None:
        self.values = values
        #: the value codec where it codes a tensor as a GroupCode says (groups aligned to
        #: rows, a width per tensor, rows centered): see :mod:`.groupcode`
        self.group = values if isinstance(values, GroupCodec) else None
        #: the code of attention's scores' operands, ``q`` and ``k`` (see :data:`SCORES_BITS`)
        self.scores = scores or scores_codec(values)
        self.norms = norms
        #: width of norm inputs in row-aligned groups (None: the codec's own)
        self.norm_bits: int | None = getattr(norms, "bits", None)
        #: GELU/SiLU derivative codes (None: their inputs go to the value codec)
        self.derivs = derivs
        #: width of attention's tensors (None: the value codec's); needs a codec taking bits=
        self.attn_bits = attn_bits
        #: width of GELU/SiLU inputs kept as values (None: derivative codes, or the codec's)
        self.act_bits = act_bits
        #: a LayerNorm's, GELU's or SiLU's output a later op saves is recomputed from the
        #: input stored here (:mod:`torchstash.derive`) instead of being stored again
        self.derive = derive
        self.name = values.name
        self.composable = getattr(values, "composable", None)

    def _aligned(self, run: int | None) -> int | None:
        """A group size near the codec's whose groups stay inside runs of ``run`` elements,
        when the value codec takes a group size per tensor."""
        if self.group is None:
            return None
        return aligned_group_size(static_size(run), self.group.group_size)

    def _row_group_size(self, x: torch.Tensor) -> int | None:
        """A group size that keeps each group inside one row (innermost dimension), where
        that costs at most twice the scales: tokens of different scale then never share a
        step (on the GPT at 4 bits, the LM head's 128-wide rows: cosine 0.9891 to 0.9905)."""
        if x.dim() < 2 or x.stride(-1) != 1:
            return None
        aligned = self._aligned(static_size(x.shape[-1]))
        if aligned is None or self.group is None:
            return None
        return aligned if 2 * aligned >= self.group.group_size else None

    def variant(self, x: torch.Tensor, site: Site) -> str:
        if x.dtype == torch.bool:
            return "bool"
        if site.func in POOL_FUNCS and site.role == "output" and x.dtype == torch.int64:
            return "pool"
        if site.op in SIGN_OPS and x.is_floating_point():
            return "sign"
        if site.op in DROPOUT_OPS and site.role == "output" and x.is_floating_point():
            return "dropmask"
        if (
            self.act_bits is not None
            and self.group is not None
            and site.op in ACT_OPS
            and site.role == "input"
            and x.is_floating_point()
        ):
            return "act"
        if (
            self.derivs is not None
            and site.op in DERIV_OPS
            and site.role == "input"
            and x.is_floating_point()
        ):
            return "deriv"
        if site.op in NORM_OPS and site.role == "input" and x.is_floating_point():
            return "norm"
        part = attention_part(x, site) if x.is_floating_point() else ""
        if part == "scores":
            return "scores"
        if part and self.attn_bits is not None and self.group is not None:
            return "attn"
        return ""

    def _stand_in_bits(self, site: Site) -> int | None:
        """``norm_bits`` for a LayerNorm's input, with ``derive``: it then stands in for the
        next projection's input too. A BatchNorm's keeps the codec's width in aligned groups:
        its output is recomputed only where no residual sum comes first (half of a ResNet's),
        so widening every input would cost more than that saves."""
        return self.norm_bits if self.derive and site.op == "layer_norm" else None

    def replays_at(self, x: torch.Tensor, site: Site) -> bool:
        """Replayed from the site less its call (:mod:`torchstash.engine.replay`) unless the
        code reads the call: attention's parts (which operand of which matmul), a pool's
        geometry, a GELU's ``approximate``; or its codec says no."""
        if site.op in ATTENTION_OPS:
            return False
        if site.op == SDPA and self.recall(x, site) is None:
            return False
        kind = self.variant(x, site)
        if kind == "pool":  # its geometry recalled (:meth:`recall`); its code checks itself
            return self.recall(x, site) is not None
        if kind in EXACT_KINDS:
            return True
        if kind == "deriv":
            return site.op != "gelu" and self.derivs is not None
        codec = self.values
        if kind == "norm" and self.norms is not None:
            layout = self._centered_layout(x, site)
            if layout is None or self._aligned(layout[1]) is None:
                codec = self.norms
        return replays_at(codec, x, site)

    def recall(self, x: torch.Tensor, site: Site) -> object:
        """What a replayed save's code reads of the call: a max pool's geometry (its
        positions are checked to give the indices back, so a geometry that no longer fits
        keeps the indices as they are)."""
        if site.op == SDPA:  # which of q, k, v it is (its code follows: attention_part)
            return site.opcall.position(x)
        if self.variant(x, site) != "pool":
            return None
        return pool_geometry(site.opcall.args, dict(site.opcall.kwargs))

    def replays_next(self) -> bool:
        return all(replays_next(c) for c in (self.values, self.norms, self.scores) if c is not None)

    def derivable(self, x: torch.Tensor, site: Site) -> bool:
        """Whether ``x``'s code may stand in for the op's output too (its values, not a
        derivative or a sign code): the engine then recomputes that output from it.

        A BatchNorm's input only at 4 bits and up: the ReLU after it zeroes the half of the
        range its code spends levels on, so at 2 bits the output's own code is closer (the
        zoo's ResNet under int2: cosine 0.80 recomputed, 0.85 coded; under int4 0.989 at
        9.8x against 0.993 at 7.2x)."""
        if site.op == "batch_norm" and getattr(self.values, "bits", 8) < 4:
            return False
        if attention_part(x, site) in ("scores", "values"):
            return True  # attention's map and output are recomputed under every strategy
        return self.derive and self.variant(x, site) in ("", "norm", "act", "attn")

    def derives_op(self, op: str, reader: str | None = None) -> bool:
        """Whether ``op``'s output is recomputed from its coded input (compiled, as
        :meth:`derivable` lets the eager engine), as ``reader``'s saved input (None: any).

        Not a BatchNorm's below 4 bits (the zoo's ResNet under int2, inductor: cosine
        0.79-0.81 recomputed, eager 0.82-0.84). Nor a BatchNorm's as a GELU's, SiLU's or
        hardswish's input where ``act_bits`` is wider than the codec: that input is kept at
        ``act_bits`` as any activation's (timm's EfficientNet-B0 under int4, whose in-place
        SiLUs eager kept so: gradient cosine 0.982, recomputed from the 4-bit BatchNorm input
        0.967)."""
        bits = getattr(self.values, "bits", 8)
        if op != "batch_norm":
            return True
        if bits < 4:
            return False
        wider = self.act_bits is not None and self.group is not None and self.act_bits > bits
        return not (reader in ACT_OPS and wider)

    def derived(self, x: torch.Tensor, site: Site, sources: list[Site]) -> None:
        """A save recomputed from codes stored here: the value codec's budget counts it."""
        told = getattr(self.values, "derived", None)
        if told is not None:
            told(x, site, sources)

    def unsupported(self, x: torch.Tensor, site: Site) -> list[str]:
        kind = self.variant(x, site)
        if kind not in EXACT_KINDS and x.is_floating_point():
            reasons = dtype_reasons(self, self.name, x.dtype)  # float64: kept as is, one warning
            if reasons:
                return reasons
        if site.op in NORM_OPS and site.role == "output":
            return [f"{site.op}'s saved statistics (mean, rstd) are small and kept exact"]
        if site.op == SDPA and not attention_part(x, site):
            return [SDPA_REASON]
        if kind == "norm" and self._centered_layout(x, site) is None:
            return [
                f"{site.op}'s input has rows of fewer than {MIN_CENTERED_ROW} elements per "
                "statistic: kept exact (per-row offsets would cost about as much as the codes)"
            ]
        if kind == "norm":
            _, run = self._centered_layout(x, site) or (False, 0)
            if self._aligned(run) is None and self.norms is not None:
                return self.norms.unsupported(x, site)
            return self.values.unsupported(x, site)
        if kind and kind not in ("attn", "act", "scores"):
            return []
        return self.values.unsupported(x, site)

    def compress(self, x: torch.Tensor, site: Site) -> Packed | torch.Tensor:
        return self.encoder(x, site)(x)

    def encoder(self, x: torch.Tensor, site: Site) -> Encoder:
        """The code ``x`` gets at ``site``, as a call of the tensor alone: a replayed save of
        the same site, shape, dtype and layout calls it instead of deciding again."""
        kind = self.variant(x, site)
        exact = EXACT_ENCODERS.get(kind)
        if exact is not None:
            return exact(site)
        if kind == "deriv":
            assert self.derivs is not None
            return AtSite(self.derivs.pack, site)
        if kind == "norm":
            layout = self._centered_layout(x, site)
            assert layout is not None  # unsupported() declined it otherwise
            channel_major, run = layout
            inner = self._centered_encoder(site, run)
            return ChannelMajor(inner) if channel_major else inner
        rows = self._row_group_size(x)
        if kind == "scores":
            return functools.partial(self._compress_scores, site=site, rows=rows)
        if self.group is None:  # variant() gives "attn" and "act" only to a group codec
            return AtSite(self.values.compress, site)
        if attention_part(x, site) == "map":
            # a map stored after all (no recipe reached it): not below q's and k's width
            widest = max(SCORES_BITS, self.attn_bits or 0)
            return self.group.encoder_as(site, GroupCode(widest, rows))
        bits = self.attn_bits if kind == "attn" else self.act_bits if kind == "act" else None
        return self.group.encoder_as(site, GroupCode(bits, rows))

    def graph_refusal(self, budgeted: bool) -> str | None:
        """Why a compiled graph does not run its codes (:mod:`torchstash.graphhooks`): its
        value codec's reason, the graph codes values only (see :meth:`value_encoder`). The
        graph recomputes what eager does under a budget, or where this code derives."""
        return graph_refusal(self.values, budgeted or self.derive)

    def value_encoder(self, x: torch.Tensor, site: Site) -> Encoder | None:
        """The encoder of a code whose restore is the value itself, which any op may read: a
        compiled graph saves a value once for every op of the backward that reads it (a
        ReLU's output for the ReLU and the next conv), so its op-specific codes (sign bits, a
        derivative's levels, a pool's positions) do not apply there. A value's own code
        where the op-aware one is a value's; the value codec's (at ``act_bits`` for a GELU's
        or SiLU's input) where it is op-specific; None for a pool's positions."""
        kind = self.variant(x, site)
        if kind in ("", "attn", "act", "norm", "scores", "bool"):
            return self.encoder(x, site)
        if kind == "pool":
            return None
        if self.group is None:
            return AtSite(self.values.compress, site)
        bits = self.act_bits if kind == "deriv" else None
        return self.group.encoder_as(site, GroupCode(bits, self._row_group_size(x)))

    def _compress_scores(self, x: torch.Tensor, site: Site, rows: int | None) -> Packed:
        """An operand of attention's scores at :data:`SCORES_BITS`, rounded to nearest."""
        packed = self.scores.compress_as(x, site, GroupCode(group_size=rows))
        told = getattr(self.values, "fixed_width", None)
        if told is not None:  # a budget (quant.auto's) counts these bits too
            told(x, site, getattr(self.scores, "bits", SCORES_BITS))
        return packed

    def _centered_layout(self, x: torch.Tensor, site: Site) -> tuple[bool, int] | None:
        """How a normalization input is laid out in rows that share a statistic: (stored
        channel-major, row length), or None when its rows are too short to code."""
        run = normalized_run(x, site)
        if run is not None and run >= MIN_CENTERED_ROW:
            return False, run
        run = channel_major_run(x, site)  # a BatchNorm's small maps: a channel over the batch
        if run is not None and run >= MIN_CENTERED_ROW:
            return True, run
        return None

    def _centered_encoder(self, site: Site, run: int) -> Encoder:
        """A normalization input coded relative to each normalized row (:mod:`.centered`):
        in row-aligned groups where the codec takes them (one kernel call: the codec
        centers), else centered here and coded by the ``norms`` codec or the codec itself."""
        aligned = self._aligned(run)
        if aligned is not None and self.group is not None:
            return self.group.encoder_as(site, GroupCode(self._stand_in_bits(site), aligned, run))
        return functools.partial(self._compress_centered, site=site, run=run)

    def _compress_centered(self, x: torch.Tensor, site: Site, run: int) -> Packed | torch.Tensor:
        """``x`` less each row's offset (scaled to one range where the codec asks), coded by
        the ``norms`` codec or the value codec; the offsets in the record."""
        codec = self.values if self.norms is None else self.norms
        scale = bool(getattr(codec, "scales_rows", False))
        centered, offsets, constant, scales = center_rows(x, run, scale)
        packed = codec.compress(centered, site)
        if not isinstance(packed, Packed):
            return x  # the codec declined the centered values: kept as is
        packed.tensors["offset"] = offsets
        packed.tensors["constant"] = constant
        if scales is not None:
            packed.tensors["row_scale"] = scales
        packed.meta["inner"] = packed.codec
        packed.codec = CENTERED
        packed.dtype = x.dtype  # the codes hold float32 centered values
        return packed

    def decompress(self, packed: Packed) -> torch.Tensor:
        decode = DECODERS.get(packed.codec)
        if decode is not None:  # what was packed says which code decodes it
            return decode(packed)
        if packed.codec == CENTERED:
            return self._decompress_centered(packed)
        return self.values.decompress(packed)

    def _decompress_centered(self, packed: Packed) -> torch.Tensor:
        """:meth:`_compress_centered` undone: the float32 centered values decoded by the
        record's own codec, each row's offset added back, and a channel-major tensor turned
        back to ``(N, C, ...)``."""
        shape, major = packed.shape, bool(packed.meta.get("channel_major"))
        if major:
            shape = torch.Size([shape[1], shape[0], *shape[2:]])
        tensors = dict(packed.tensors)
        offsets, constant = tensors.pop("offset"), tensors.pop("constant")
        assert isinstance(offsets, torch.Tensor) and isinstance(constant, torch.Tensor)
        scales = tensors.pop("row_scale", None)
        assert scales is None or isinstance(scales, torch.Tensor)
        meta = {k: v for k, v in packed.meta.items() if k not in ("inner", "channel_major")}
        inner = packed.meta["inner"]
        assert isinstance(inner, str)
        record = replace(
            packed, codec=inner, shape=shape, dtype=torch.float32, tensors=tensors, meta=meta
        )
        x = uncenter(self.decompress(record), offsets, constant, scales, packed.dtype)
        return x.transpose(0, 1) if major else x
