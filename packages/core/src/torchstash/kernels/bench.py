"""CPU benchmark: compiled kernels against the pure-PyTorch reference.

``python -m torchstash.kernels.bench [--mib 64] [--repeat 5] [--json]``. Sizes are
of the unpacked side: ``mib`` MiB of uint8 codes for pack/unpack, ``mib`` MiB of
float32 output for philox_uniform. Times are medians of ``repeat`` runs after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from .bitpack import pack_bits, unpack_bits
from .philox import philox_uniform

__all__ = ["BenchRow", "main", "run"]


@dataclass(frozen=True)
class BenchRow:
    op: str
    bits: int | None
    mib: float
    ref_ms: float
    kernel_ms: float
    speedup: float
    note: str = ""


def _median_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: page faults, thread pools, first-call dispatch
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _row(
    op: str,
    bits: int | None,
    mib: float,
    ref: Callable[[], object],
    kernel: Callable[[], object],
    repeat: int,
    note: str = "",
) -> BenchRow:
    ref_ms, kernel_ms = _median_ms(ref, repeat), _median_ms(kernel, repeat)
    return BenchRow(op, bits, mib, ref_ms, kernel_ms, ref_ms / kernel_ms, note)


def run(mib: float = 64, repeat: int = 5, seed: int = 0) -> list[BenchRow]:
    """Times every op; raises KernelUnavailable when the kernels cannot be built."""
    n = int(mib * 2**20)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for bits in (1, 2, 4, 8):
        codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8, generator=gen)
        packed = pack_bits(codes, bits, impl="kernel")
        note = "plain copy on both sides" if bits == 8 else ""
        rows.append(
            _row(
                "pack_bits",
                bits,
                mib,
                lambda c=codes, b=bits: pack_bits(c, b, impl="ref"),
                lambda c=codes, b=bits: pack_bits(c, b, impl="kernel"),
                repeat,
                note,
            )
        )
        rows.append(
            _row(
                "unpack_bits",
                bits,
                mib,
                lambda p=packed, b=bits: unpack_bits(p, b, n, impl="ref"),
                lambda p=packed, b=bits: unpack_bits(p, b, n, impl="kernel"),
                repeat,
                note,
            )
        )
    floats = n // 4
    rows.append(
        _row(
            "philox_uniform",
            None,
            mib,
            lambda: philox_uniform(floats, 1234, 5, impl="ref"),
            lambda: philox_uniform(floats, 1234, 5, impl="kernel"),
            repeat,
        )
    )
    return rows


def format_table(rows: Sequence[BenchRow]) -> str:
    lines = [f"{'op':<16}{'bits':>5}{'MiB':>7}{'ref ms':>11}{'kernel ms':>11}{'speedup':>10}  note"]
    for r in rows:
        bits = "-" if r.bits is None else str(r.bits)
        lines.append(
            f"{r.op:<16}{bits:>5}{r.mib:>7g}{r.ref_ms:>11.2f}{r.kernel_ms:>11.2f}"
            f"{r.speedup:>9.1f}x  {r.note}".rstrip()
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchstash.kernels.bench", description=__doc__)
    parser.add_argument("--mib", type=float, default=64, help="MiB of codes / float output (64)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per case; median (5)")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = parser.parse_args(argv)
    rows = run(args.mib, args.repeat)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
