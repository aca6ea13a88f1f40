"""``quant.int8/int4/int2/int1``: per-group stochastic quantization (ActNN's and GACT's scheme).

Groups of ``group_size`` consecutive elements share a bfloat16 minimum and step (a group of
subnormals is coded scaled by ``2**126``, so its step keeps bfloat16's precision); codes are
rounded stochastically (unbiased), clamped (no wrap-around), and packed bit-dense, in one
fused kernel pass (``torchstash.kernels.group_quantize``). The tensor is taken in memory
order, so transposed and channels_last tensors need no copy and come back with their strides.
"""

from __future__ import annotations

import torch

from torchstash.compressor import BaseCompressor
from torchstash.kernels import (
    group_dequantize,
    group_quantize,
    row_group_dequantize,
    row_group_quantize,
)
from torchstash.layout import memory_order, restore
from torchstash.packed import Packed
from torchstash.seeds import SeedStream
from torchstash.site import Site

from ._dtypes import dtype_reasons
from ._options import check_bits, check_group_size
from .centered import center_rows
from .groupcode import GroupCode

#: what a group code's record is called: its decoder's name (:data:`~.opaware.DECODERS`)
GROUP = "quant.group"
#: a group code of rows less their offsets (:mod:`.centered`), made in one kernel call
GROUP_ROWS = "quant.group_rows"


class GroupQuantizer(BaseCompressor):
    """A :class:`~.groupcode.GroupCodec`: :meth:`compress_as` codes a tensor at another width,
    group size or with its rows centered (:mod:`.centered`, one kernel call, undone by
    :func:`decode_rows`); :meth:`encoder_as` settles that once for a replayed save."""

    lossless = False
    #: where no group size fits a normalization's rows, its groups span rows with one step:
    #: the rows are scaled to one range first (.centered)
    scales_rows = True
    #: reads nothing of the call; a 1-bit code widened for NaN takes other bytes, and the
    #: engine's replay checks a code's bytes against its recording's
    replays = True

    def __init__(
        self,
        bits: int = 8,
        group_size: int = 256,
        stochastic: bool = True,
        seed: int | None = None,
        name: str | None = None,
    ) -> None:
        self.name = name or f"quant.int{bits}"
        self.bits = check_bits(bits, self.name)
        self.group_size = check_group_size(group_size, self.name)
        self.stochastic = bool(stochastic)
        self.seeds = SeedStream(seed)

    def unsupported(self, x: torch.Tensor, site: Site) -> list[str]:
        return dtype_reasons(self, self.name, x.dtype)

    def compress(self, x: torch.Tensor, site: Site) -> Packed:
        return self.encode(x, self.bits, self.group_size, None)

    def compress_as(self, x: torch.Tensor, site: Site, code: GroupCode) -> Packed:
        """``code``'s width and group size override the codec's own for this tensor (mixed
        precision, groups aligned to normalized rows); both are kept in the record. With
        ``code.rows``, ``x`` less each row's offset is coded (:mod:`.centered`), the offsets
        and constant flags in the record too: one kernel call
        (:func:`~torchstash.kernels.row_group_quantize`) where two wrote and read the
        centered values."""
        return self.encode(x, code.bits or self.bits, code.group_size or self.group_size, code.rows)

    def encoder_as(self, site: Site, code: GroupCode) -> GroupEncoder:
        """:meth:`compress_as` with ``code`` settled: what a replayed save calls (its code
        depends on nothing but the tensor)."""
        return GroupEncoder(
            self, code.bits or self.bits, code.group_size or self.group_size, code.rows
        )

    def encode(self, x: torch.Tensor, bits: int, group_size: int, rows: int | None) -> Packed:
        """``x`` coded at ``bits`` in groups of ``group_size``, less each ``rows``-element
        row's offset where ``rows`` is set (see :meth:`compress_as`)."""
        if rows is not None and bits > 1:
            return self._compress_rows(x, rows, bits, group_size)
        if rows is not None:  # 1 bit may go to 2 (below): centered values first
            centered, offsets, constant, _ = center_rows(x, rows)
            return with_offsets(self.encode(centered, bits, group_size, None), x, offsets, constant)
        flat, inverse = memory_order(x)
        seed = self.seeds.next()
        codes, lo, step = group_quantize(
            flat, bits, group_size, seed=seed, stochastic=self.stochastic, checked=False
        )
        if bits == 1 and bool(torch.signbit(step).any()):
            # A group holding NaN or Inf: at 1 bit every non-finite value would come back
            # as NaN (one code for all three), so such a tensor is coded at 2 bits, which
            # keeps NaN, +Inf and -Inf where they were. One host sync per 1-bit tensor.
            bits = 2
            codes, lo, step = group_quantize(
                flat, bits, group_size, seed=seed, stochastic=self.stochastic, checked=False
            )
        packed = Packed(GROUP, x.shape, x.dtype, x.device, {"codes": codes, "lo": lo, "step": step})
        packed.meta.update(bits=bits, group_size=group_size, order=inverse)
        return packed

    def _compress_rows(self, x: torch.Tensor, rows: int, bits: int, group_size: int) -> Packed:
        """The record :meth:`compress` makes of ``center_rows(x, rows)``'s values, with the
        offsets and flags, from one kernel call (bit for bit the same)."""
        codes, lo, step, offsets, constant = row_group_quantize(
            x,
            rows,
            bits,
            group_size,
            seed=self.seeds.next(),
            stochastic=self.stochastic,
            checked=False,
        )
        tensors = {"codes": codes, "lo": lo, "step": step, "offset": offsets, "constant": constant}
        packed = Packed(GROUP_ROWS, x.shape, x.dtype, x.device, tensors)
        packed.meta.update(bits=bits, group_size=group_size, order=None)
        return packed

    def graph_refusal(self, recomputes: bool) -> str | None:
        """Why a compiled graph does not run its codes (None where it does, see
        :mod:`torchstash.graphhooks`). At 8 bits it always runs them. Below, the zoo comes to
        eager's accuracy once the graph recomputes what eager recomputes, and so do most
        models outside it at 4 bits since the graph names and keeps what eager does (a
        SiLU's input after a BatchNorm at ``act_bits``, ``nn.MultiheadAttention``'s parts, a
        value through the ``permute`` its op reads it by: ``aot_eager_decomp_partition``,
        eager in brackets, MobileNetV3-small 0.9963 (0.9954), ViT-B/16 0.9978 (0.9941)).
        Not all: a fused attention's output is coded beside its operands where eager
        recomputes it (Hugging Face BERT and ViT, timm DeiT: 1.11-1.15x eager's bytes), and
        timm's EfficientNet-B0 comes to 0.9797 (0.9820) once the graph codes its batch as
        eager does (``docs/compile.md``). So int4 and int2 run eagerly. At 1 bit the code
        also reads on the host whether a group holds NaN or Inf."""
        if self.bits == 8:
            return None
        if self.bits in (4, 2):
            return (
                f"at {self.bits} bits a compiled graph keeps more bytes than eager or falls "
                "short of its gradients on models outside the test zoo (Hugging Face BERT, "
                "timm DeiT and EfficientNet-B0: docs/compile.md), so it runs eagerly; "
                "quant.int8 and quant.fp8 run in the graph"
            )
        return (
            "at 1 bit the code reads on the host whether a group holds NaN or Inf, which a "
            "compiled graph cannot; quant.int8 and quant.fp8 run in the graph"
        )

    def decompress(self, packed: Packed) -> torch.Tensor:
        return decode_group(packed)


class GroupEncoder:
    """One tensor's group code with its settings decided (:meth:`GroupQuantizer.encoder_as`):
    a call straight to the kernel, where :meth:`~GroupQuantizer.compress_as` reads the
    settings again each time."""

    __slots__ = ("bits", "codec", "group_size", "rows")

    def __init__(self, codec: GroupQuantizer, bits: int, group_size: int, rows: int | None) -> None:
        self.codec, self.bits, self.group_size, self.rows = codec, bits, group_size, rows

    def __call__(self, x: torch.Tensor) -> Packed:
        return self.codec.encode(x, self.bits, self.group_size, self.rows)


def with_offsets(
    packed: Packed, x: torch.Tensor, offsets: torch.Tensor, constant: torch.Tensor
) -> Packed:
    """The group code of ``x``'s centered values (``packed``) as a record of ``x`` less its
    rows' offsets, which :func:`decode_rows` decodes as it decodes the fused kernel's."""
    packed.tensors.update(offset=offsets, constant=constant)
    packed.codec, packed.dtype = GROUP_ROWS, x.dtype
    return packed


def decode_rows(packed: Packed, shape: torch.Size) -> torch.Tensor:
    """A ``rows=`` record decoded and restored (offsets put back: :mod:`.centered`) in
    one kernel call, shaped ``shape`` (the stored order), in the record's dtype."""
    names = ("codes", "lo", "step", "offset", "constant")
    codes, lo, step, offsets, constant = (packed.tensors[k] for k in names)
    assert isinstance(codes, torch.Tensor) and isinstance(lo, torch.Tensor)
    assert isinstance(step, torch.Tensor) and isinstance(offsets, torch.Tensor)
    assert isinstance(constant, torch.Tensor)
    bits, group_size = packed.meta["bits"], packed.meta["group_size"]
    assert isinstance(bits, int) and isinstance(group_size, int)
    n = packed.numel
    run = n // max(offsets.numel(), 1)
    flat = row_group_dequantize(
        codes, lo, step, offsets, constant, bits, group_size, run, n, packed.dtype
    )
    return flat.view(shape)


def decode_group(packed: Packed) -> torch.Tensor:
    """A group code's tensor (:meth:`GroupQuantizer.encode`, rows not centered), back in
    its shape and strides: the record says all the decoder needs."""
    codes, lo, step = (packed.tensors[k] for k in ("codes", "lo", "step"))
    assert isinstance(codes, torch.Tensor) and isinstance(lo, torch.Tensor)
    assert isinstance(step, torch.Tensor)
    bits, group_size = packed.meta["bits"], packed.meta["group_size"]
    assert isinstance(bits, int) and isinstance(group_size, int)
    flat = group_dequantize(
        codes, lo, step, bits, group_size, packed.numel, packed.dtype, checked=False
    )
    order = packed.meta.get("order")
    return restore(flat, packed.shape, order if isinstance(order, tuple) else None)
