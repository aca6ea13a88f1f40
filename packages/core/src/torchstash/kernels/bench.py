"""Compiled kernels against the pure-PyTorch reference, on the CPU or a GPU.

``python -m torchstash.kernels.bench [--mib 64] [--repeat 5] [--threads N] [--json]
[--check RATIO] [--suite bitpack|groupquant|channelquant|sparse] [--device cpu|cuda]``.
On a GPU every timed call ends with a device synchronisation, so a time is the whole op's. Sizes are of the unpacked side:
``mib`` MiB of uint8 codes for pack/unpack, ``mib`` MiB of float32 output for philox_uniform,
``mib`` MiB of float32 input (quantize) or output (dequantize, group size 256) for the
``groupquant`` suite, ``mib`` MiB of float32 input or output for the ``channelquant`` suite
(8-bit codes, stochastic rounding; a (16, 16 heads, ...) layout, then 512 channels with
``inner = 1``), ``mib`` MiB of float32 input or output for the ``sparse`` suite (top-k masks
over the whole tensor and per row, then the storage ops on a 10% mask). Reference and kernel
runs alternate after a warm-up; speedups are
ratios of medians ("best": of the fastest runs). ``--check RATIO`` exits 1 when a row
other than the write-bound ones (8-bit copies, offsets_scatter) stays below RATIO after one re-measurement with twice the
runs (shared machines are noisy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial

import torch

from torchstash.errors import KernelUnavailable

from .bitpack import pack_bits, unpack_bits
from .channelquant import channel_dequantize, channel_minmax, channel_quantize
from .groupquant import group_dequantize, group_quantize
from .loader import require
from .philox import philox_uniform
from .sparse import mask_compact, mask_offsets, mask_scatter, offsets_scatter, topk_mask

__all__ = ["SUITES", "BenchRow", "failures", "main", "run"]

#: Case families: ``bitpack`` (pack/unpack at 1-8 bits, philox_uniform),
#: ``groupquant`` (group_quantize/group_dequantize at 2 and 8 bits) and ``channelquant``
#: (channel_minmax/channel_quantize/channel_dequantize per head and per channel) and
#: ``sparse`` (topk_mask, mask_compact/mask_scatter, mask_offsets/offsets_scatter).
SUITES = ("bitpack", "groupquant", "channelquant", "sparse")
_COPY_OPS = ("pack_bits", "unpack_bits")  # plain copies at 8 bits


@dataclass(frozen=True)
class BenchRow:
    op: str
    bits: int | None
    mib: float
    ref_ms: float  # median
    kernel_ms: float  # median
    speedup: float  # of the medians
    best_speedup: float  # fastest reference run / fastest kernel run
    #: bound by writing the output on both sides, so not held to ``--check``: the 8-bit
    #: copies, and offsets_scatter (its reference is one index_put into zeros; 5.7-5.9x)
    copy: bool = False
    note: str = ""


#: Ops whose reference is already a single write-bound pass (see ``BenchRow.copy``).
_WRITE_BOUND_OPS = frozenset({"offsets_scatter"})


def _sync_for(device: torch.device) -> Callable[[], None]:
    """What ends a timed call: nothing on the CPU, a synchronisation on a GPU."""
    if device.type == "cuda":
        return partial(torch.cuda.synchronize, device)
    return lambda: None


def _ms(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - start) * 1e3


def _row(
    op: str,
    bits: int | None,
    mib: float,
    ref: Callable[[], object],
    kernel: Callable[[], object],
    repeat: int,
    sync: Callable[[], None],
) -> BenchRow:
    ref(), kernel()  # warm-up: page faults, thread pools, first-call dispatch
    ref_ms, kernel_ms = [], []
    for _ in range(max(1, repeat)):
        ref_ms.append(_ms(ref, sync))
        kernel_ms.append(_ms(kernel, sync))
    ref_med, kernel_med = statistics.median(ref_ms), statistics.median(kernel_ms)
    copy = (bits == 8 and op in _COPY_OPS) or op in _WRITE_BOUND_OPS
    note = ""
    if bits == 8 and op in _COPY_OPS:
        note = "plain copy on both sides; any gain is the huge-page output"
    elif op in _WRITE_BOUND_OPS:
        note = "both sides mostly write the dense output; not gated"
    return BenchRow(
        op, bits, mib, ref_med, kernel_med, ref_med / kernel_med,
        min(ref_ms) / min(kernel_ms), copy, note,
    )  # fmt: skip


# (op, bits, reference call, kernel call[, note])
_Case = (
    tuple[str, "int | None", Callable[[], object], Callable[[], object]]
    | tuple[str, "int | None", Callable[[], object], Callable[[], object], str]
)


def _cases(mib: float, seed: int, dev: torch.device) -> list[_Case]:
    """Every benchmarked case, inputs included."""
    n = int(mib * 2**20)
    gen = torch.Generator().manual_seed(seed)
    cases: list[_Case] = []
    for bits in (1, 2, 4, 8):
        codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8, generator=gen).to(dev)
        packed = pack_bits(codes, bits, impl="kernel")
        cases.append(
            ("pack_bits", bits, partial(pack_bits, codes, bits, impl="ref"),
             partial(pack_bits, codes, bits, impl="kernel"))
        )  # fmt: skip
        cases.append(
            ("unpack_bits", bits, partial(unpack_bits, packed, bits, n, impl="ref"),
             partial(unpack_bits, packed, bits, n, impl="kernel"))
        )  # fmt: skip
    cases.append(
        ("philox_uniform", None,
         partial(philox_uniform, n // 4, 1234, 5, device=dev, impl="ref"),
         partial(philox_uniform, n // 4, 1234, 5, device=dev, impl="kernel"))
    )  # fmt: skip
    return cases


def _group_cases(mib: float, seed: int, dev: torch.device) -> list[_Case]:
    """group_quantize and group_dequantize on ``mib`` MiB of float32, group size 256."""
    n = int(mib * 2**20) // 4
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dev)
    cases: list[_Case] = []
    for bits in (2, 8):
        q = group_quantize(x, bits, seed=1234, impl="kernel")
        cases.append(
            ("group_quantize", bits, partial(group_quantize, x, bits, seed=1234, impl="ref"),
             partial(group_quantize, x, bits, seed=1234, impl="kernel"))
        )  # fmt: skip
        cases.append(
            ("group_dequantize", bits,
             partial(group_dequantize, *q, bits, 256, n, torch.float32, impl="ref"),
             partial(group_dequantize, *q, bits, 256, n, torch.float32, impl="kernel"))
        )  # fmt: skip
    return cases


def _channel_cases(mib: float, seed: int, dev: torch.device) -> list[_Case]:
    """The three channel ops on ``mib`` MiB of float32: (16, 16, inner) per head, then
    (outer, 512) per channel (inner 1); stochastic rounding, Mesa's lo and step."""
    n = int(mib * 2**20) // 4
    gen = torch.Generator().manual_seed(seed)
    cases: list[_Case] = []
    for channels, inner, note in (
        (16, n // 256, f"heads: C=16, inner={n // 256}"),
        (512, 1, "channels: C=512, inner=1"),
    ):
        x = torch.randn(n // (channels * inner) * channels * inner, generator=gen).to(dev)
        mn, mx = channel_minmax(x, inner, channels, impl="kernel")
        step = (mx - mn) / 252
        codes = channel_quantize(x, mn, step, inner, seed=1234, impl="kernel")
        f32 = torch.float32
        cases += [
            ("channel_minmax", 8, partial(channel_minmax, x, inner, channels, impl="ref"),
             partial(channel_minmax, x, inner, channels, impl="kernel"), note),
            ("channel_quantize", 8,
             partial(channel_quantize, x, mn, step, inner, seed=1234, impl="ref"),
             partial(channel_quantize, x, mn, step, inner, seed=1234, impl="kernel"), note),
            ("channel_dequantize", 8,
             partial(channel_dequantize, codes, mn, step, inner, f32, impl="ref"),
             partial(channel_dequantize, codes, mn, step, inner, f32, impl="kernel"), note),
        ]  # fmt: skip
    return cases


def _sparse_cases(mib: float, seed: int, dev: torch.device) -> list[_Case]:
    """topk_mask on ``mib`` MiB of float32: one segment (exact and at bfloat16 precision),
    rows of 1024 and rows of 64; then the storage ops on a 10% mask of one segment."""
    n = int(mib * 2**20) // 4 // 1024 * 1024
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dev)
    cases: list[_Case] = []
    for segments, k, exact, note in (
        (1, n // 100, True, "1 segment, k = 1%"),
        (1, n // 100, False, "1 segment, k = 1%, exact=False"),
        (n // 1024, 102, True, "rows of 1024, k = 102"),
        (n // 64, 6, True, "rows of 64, k = 6"),
    ):
        cases.append(
            ("topk_mask", None, partial(topk_mask, x, segments, k, exact=exact, impl="ref"),
             partial(topk_mask, x, segments, k, exact=exact, impl="kernel"), note)
        )  # fmt: skip
    kept = n // 10
    mask = topk_mask(x, 1, kept, impl="kernel")
    values = mask_compact(x, mask, kept, impl="kernel")
    offsets, counts = mask_offsets(mask, n, kept, impl="kernel")
    note = "10% of one segment"
    cases += [
        ("mask_compact", None, partial(mask_compact, x, mask, kept, impl="ref"),
         partial(mask_compact, x, mask, kept, impl="kernel"), note),
        ("mask_scatter", None, partial(mask_scatter, mask, values, n, impl="ref"),
         partial(mask_scatter, mask, values, n, impl="kernel"), note),
        ("mask_offsets", None, partial(mask_offsets, mask, n, kept, impl="ref"),
         partial(mask_offsets, mask, n, kept, impl="kernel"), note),
        ("offsets_scatter", None, partial(offsets_scatter, offsets, counts, values, n, impl="ref"),
         partial(offsets_scatter, offsets, counts, values, n, impl="kernel"), note),
    ]  # fmt: skip
    return cases


def run(
    mib: float = 64,
    repeat: int = 5,
    seed: int = 0,
    *,
    check: float = 0.0,
    suites: Sequence[str] = ("bitpack",),
    device: torch.device | str = "cpu",
) -> list[BenchRow]:
    """Times every op of ``suites`` (see SUITES) on ``device``; raises KernelUnavailable when
    the kernels cannot be built (or were built without that device). The command line runs
    every suite.

    With ``check > 0``, a non-copy row below ``check`` is measured once more with twice
    the runs and the new row kept.
    """
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        raise ValueError(
            f"unknown bench suite(s) {unknown}; allowed values are {', '.join(SUITES)}"
        )
    dev = torch.device(device)
    require(dev)
    cases: list[_Case] = []
    if "bitpack" in suites:
        cases += _cases(mib, seed, dev)
    if "groupquant" in suites:
        cases += _group_cases(mib, seed, dev)
    if "channelquant" in suites:
        cases += _channel_cases(mib, seed, dev)
    if "sparse" in suites:
        cases += _sparse_cases(mib, seed, dev)
    sync = _sync_for(dev)
    rows = []
    for op, bits, ref, kernel, *note in cases:
        row = _row(op, bits, mib, ref, kernel, repeat, sync)
        if check > 0 and failures([row], check):
            row = _row(op, bits, mib, ref, kernel, 2 * repeat, sync)
        rows.append(
            replace(row, note="; ".join(filter(None, (note[0], row.note)))) if note else row
        )
    return rows


def failures(rows: Sequence[BenchRow], ratio: float) -> list[BenchRow]:
    """The rows (8-bit copies excepted) whose median speedup is below ``ratio``."""
    return [r for r in rows if not r.copy and r.speedup < ratio]


def format_table(rows: Sequence[BenchRow]) -> str:
    head = f"{'op':<20}{'bits':>5}{'MiB':>6}{'ref ms':>10}{'kernel ms':>11}{'speedup':>9}{'best':>8}  note"
    lines = [head]
    for r in rows:
        bits = "-" if r.bits is None else str(r.bits)
        lines.append(
            f"{r.op:<20}{bits:>5}{r.mib:>6g}{r.ref_ms:>10.2f}{r.kernel_ms:>11.2f}"
            f"{r.speedup:>8.1f}x{r.best_speedup:>7.1f}x  {r.note}".rstrip()
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchstash.kernels.bench", description=__doc__)
    parser.add_argument("--mib", type=float, default=64, help="MiB of codes / float output (64)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per case; median (5)")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch.set_num_threads (default: keep)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    parser.add_argument(
        "--check", type=float, default=0.0, metavar="RATIO", help="exit 1 if a speedup is below"
    )
    parser.add_argument(
        "--suite", action="append", choices=SUITES, help="a case family (repeatable; default: all)"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)  # the kernels use at::get_num_threads() too
    try:
        rows = run(
            args.mib, args.repeat, check=args.check, suites=args.suite or SUITES, device=args.device
        )
    except KernelUnavailable as exc:
        print(f"cannot benchmark: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        dev = torch.device(args.device)
        where = (
            torch.cuda.get_device_name(dev)
            if dev.type == "cuda"
            else f"{torch.get_num_threads()} threads"
        )
        print(f"torch {torch.__version__}, {where}")
        print(format_table(rows))
    slow = failures(rows, args.check) if args.check > 0 else []
    for r in slow:
        print(
            f"too slow: {r.op} bits={r.bits}: {r.speedup:.1f}x < {args.check:g}x",
            file=sys.stderr,
        )
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main())
