"""``python -m torchstash_bench.anchors``: the published methods' own tables, in one run.

Two settings others reported, each beside stock PyTorch and per-block checkpointing:

* ``mesa-deit-s``: Mesa's, timm's DeiT-S at batch 128 on 224x224 images under mixed precision
  (float16 on CUDA, bfloat16 on the CPU); Mesa reported 8,459 -> 3,840 MB of training memory
  for its 8-bit policy.
* ``gact-resnet50``: GACT's, torchvision's ResNet-50 at batch 64 in float32; a user measured
  activation memory 5,208.7 -> 650.6 MB and peak allocated 5,641 -> 3,446 MB at L2.2 (an
  average of 2 bits, which ``quant.auto`` allocates by default).

Each method trains its own copy of one model (AdamW). Memory is measured with one copy alive
at a time, by the allocator, so every method is counted alike whatever it keeps (codes, block
inputs, autocast's low-precision copies of the weights): ``held MB``, what the forward adds
and leaves for backward (GACT's "activation memory"; on the CPU glibc's heap, read on one
thread: :mod:`torchstash.testing.heap`), and on CUDA ``peak MB``, the allocator's peak over a
whole step (forward, backward, optimizer step, the weights and the optimizer's state included,
as the papers measured). Speed is measured with every copy alive, the methods taking turns
in shuffled rounds of a few steps each (:mod:`torchstash_bench.turns`): images per second
from the median step. ``--scale tiny`` runs small images and batches (a CPU check of the
bench itself).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from torch import Tensor, nn

from torchstash.testing import heap

from .common import (
    default_device,
    error_text,
    fmt,
    jsonable,
    num_threads,
    rows_table,
    share,
    split_names,
    timing_arguments,
)
from .compare_methods import CHECKPOINT, Attached, Method, methods
from .turns import turns


@dataclass(frozen=True)
class Anchor:
    """One published setting: its model, batch, image size, precision and methods."""

    name: str
    build: Callable[[int], nn.Module]  # from the image size
    batch: int
    image: int
    #: the autocast dtype on CUDA (the CPU runs bfloat16); None: float32
    autocast: torch.dtype | None
    methods: tuple[str, ...]
    reported: str


def _deit_small(image: int) -> nn.Module:
    import timm

    patch = 16 if image >= 64 else 8
    model: nn.Module = timm.create_model(
        "deit_small_patch16_224", img_size=image, patch_size=patch, num_classes=1000
    )
    return model


def _resnet50(image: int) -> nn.Module:
    import torchvision

    model: nn.Module = torchvision.models.resnet50()
    return model


ANCHORS = (
    Anchor(
        "mesa-deit-s",
        _deit_small,
        128,
        224,
        torch.float16,
        ("none", CHECKPOINT, "quant.mesa", "quant.int8", "quant.auto"),
        "Mesa: 8,459 -> 3,840 MB at 8 bits (DeiT-S, batch 128, AMP)",
    ),
    Anchor(
        "gact-resnet50",
        _resnet50,
        64,
        224,
        None,
        ("none", CHECKPOINT, "quant.auto", "quant.int2", "quant.int4"),
        "GACT L2.2: activations 5,208.7 -> 650.6 MB, peak 5,641 -> 3,446 MB (ResNet-50, batch 64)",
    ),
)

#: ``--scale tiny``: batch and image size for a quick run of the bench itself
TINY = (4, 32)


@dataclass
class Run:
    method: Method
    attached: Attached | None = None
    optimizer: torch.optim.Optimizer | None = None
    error: str | None = None
    held: int | None = None
    peak: int | None = None
    times: list[float] | None = None


def _precision(anchor: Anchor, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if anchor.autocast is None:
        return contextlib.nullcontext()
    dtype = anchor.autocast if device.type == "cuda" else torch.bfloat16
    return torch.autocast(device.type, dtype=dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _attached(run: Run, base: nn.Module, device: torch.device) -> Iterator[None]:
    """``run``'s method on a fresh copy of ``base`` with its optimizer, closed afterwards."""
    run.attached = run.method.attach(copy.deepcopy(base).to(device))
    run.optimizer = torch.optim.AdamW(run.attached.model.parameters(), lr=1e-4)
    try:
        yield
    finally:
        run.attached.close()
        run.attached = run.optimizer = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _allocated(device: torch.device) -> int | None:
    """Bytes the device's allocator has handed out (CPU: glibc's heap), or None."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return heap.heap_bytes() if device.type == "cpu" and heap.available() else None


def _step(run: Run, anchor: Anchor, x: Tensor, y: Tensor, gauge: bool = False) -> None:
    """One training step; with ``gauge``, what its forward left for backward read first."""
    att, opt = run.attached, run.optimizer
    assert att is not None and opt is not None
    opt.zero_grad(set_to_none=True)
    before = _allocated(x.device) if gauge else None
    with _precision(anchor, x.device):
        loss = F.cross_entropy(att.forward(x).float(), y)
    if before is not None:
        after = _allocated(x.device)
        run.held = None if after is None else after - before
    loss.backward()
    opt.step()


def measure(
    anchor: Anchor,
    names: Sequence[str],
    device: torch.device,
    *,
    batch: int,
    image: int,
    warmup: int,
    steps: int,
) -> list[dict[str, Any]]:
    """One row per method: held and peak bytes (one copy alive), then images per second
    (every copy alive, taking turns)."""
    torch.manual_seed(0)
    base = anchor.build(image)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, image, image, generator=g).to(device)
    y = torch.randint(0, 1000, (batch,), generator=g).to(device)
    runs = [Run(m) for m in methods(list(names))]
    for run in runs:  # memory: alone on the device
        try:
            with _attached(run, base, device):
                for _ in range(2):
                    _step(run, anchor, x, y)
                _sync(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                one_thread = num_threads(1) if device.type == "cpu" else contextlib.nullcontext()
                with one_thread:
                    _step(run, anchor, x, y, gauge=True)
                _sync(device)
                if device.type == "cuda":
                    run.peak = torch.cuda.max_memory_allocated(device)
        except Exception as e:  # a method that cannot take this model: its row says why
            run.error = error_text(e)
    live = [r for r in runs if r.error is None]
    with contextlib.ExitStack() as stack:  # speed: every copy alive, taking turns
        for run in live:
            stack.enter_context(_attached(run, base, device))
            run.times = []
        for _ in range(warmup):
            for run in live:
                _step(run, anchor, x, y)
        for run, timed in turns(live, steps):  # shuffled rounds, blocks of steps
            _sync(device)
            t0 = time.perf_counter()
            _step(run, anchor, x, y)
            _sync(device)
            if timed:
                assert run.times is not None
                run.times.append(time.perf_counter() - t0)
    stock = runs[0]
    stock_s = statistics.median(stock.times) if stock.times else None
    rows = []
    for run in runs:
        s = statistics.median(run.times) if run.times else None
        rows.append(
            {
                "anchor": anchor.name,
                "method": run.method.name,
                "batch": batch,
                "image": image,
                "held_bytes": run.held,
                "held_share": run.held / stock.held
                if run.held is not None and stock.held
                else None,
                "peak_bytes": run.peak,
                "images_per_s": batch / s if s else None,
                "ratio": s / stock_s if s and stock_s else None,
                "error": run.error,
            }
        )
    return rows


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f}"


def table(rows: Sequence[dict[str, Any]], title: str) -> Any:
    columns = [
        ("setting", lambda r: r["anchor"]),
        ("method", lambda r: r["method"]),
        ("held MB", lambda r: _mb(r["held_bytes"])),
        ("held", share("held_share")),
        ("peak MB", lambda r: _mb(r["peak_bytes"])),
        ("images/s", lambda r: fmt(r["images_per_s"], ".1f")),
        ("x stock", lambda r: fmt(r["ratio"], ".2f", "x")),
    ]
    return rows_table(title, columns, rows, failed="error")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchstash_bench.anchors",
        description="Mesa's DeiT-S and GACT's ResNet-50 settings: memory held for backward, "
        "peak memory (CUDA) and images per second, beside stock and per-block checkpointing.",
    )
    names = ",".join(a.name for a in ANCHORS)
    p.add_argument("--anchors", type=split_names, default=None, help=f"default: {names}")
    p.add_argument("--strategies", type=split_names, default=None, help="methods beside stock")
    p.add_argument("--scale", choices=("paper", "tiny"), default="paper")
    p.add_argument("--batch", type=int, default=None, help="batch (default: the paper's)")
    timing_arguments(p, threads=None, warmup=3, steps=10)
    p.add_argument("--json", metavar="PATH", default=None, help="also write the rows as JSON")
    return p


def main(argv: Sequence[str] | None = None, console: Console | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = console or Console(highlight=False)
    device = torch.device(args.device) if args.device else default_device()
    chosen = args.anchors or [a.name for a in ANCHORS]
    unknown = set(chosen) - {a.name for a in ANCHORS}
    if unknown:
        console.print(f"unknown settings: {', '.join(sorted(unknown))}")
        return 2
    rows: list[dict[str, Any]] = []
    threads = contextlib.nullcontext() if args.threads is None else num_threads(args.threads)
    with threads:
        for anchor in ANCHORS:
            if anchor.name not in chosen:
                continue
            batch, image = TINY if args.scale == "tiny" else (anchor.batch, anchor.image)
            got = measure(
                anchor,
                args.strategies or anchor.methods,
                device,
                batch=args.batch or batch,
                image=image,
                warmup=args.warmup,
                steps=args.steps,
            )
            rows += got
            console.print(
                table(
                    got,
                    f"{anchor.name} on {device.type}, batch {args.batch or batch}, {image}x{image}",
                )
            )
            console.print(f"reported: {anchor.reported}")
    if args.json:
        Path(args.json).write_text(json.dumps(jsonable(rows), indent=2))
    return 0 if all(r["error"] is None for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
