"""``python -m torchstash_bench.speed``: what a training step costs under each strategy.

Four models none of the tests use, each where a different cost shows: a host-bound MLP
(64 small linears: the engine's Python per saved tensor is most of the step), a small CNN
(conv-BN-ReLU: kernels and rewrites), a pre-norm GPT with SDPA of width 512 (the
transformer users train) and the same GPT at width 64 (``gpt-host``: its saves are coded but
its kernels cost next to nothing, so its step shows the host's work per code, which sets a
GPU step's cost). Every method runs on its own copy of one model; after the warm-up
steps (``quant.auto`` allocates there) the methods take turns in one process, in shuffled
rounds of a few steps each, each timed step after one of its own method
(:mod:`torchstash_bench.turns`: in a fixed order a method reads faster after another
torchstash method, whose steps warm its code), and each gets its median step time over
stock's (``x stock``) and its mean over stock's mean
(``x mean``: a step that runs now and then, ``quant.auto`` measuring and allocating, weighs
in the mean and not in the median, as it does in an epoch). ``us/saved`` is the step time above stock's
divided by the tensors stock saves in a step; ``engine us`` the time a step spends inside
the engine's hooks (pack, unpack, module entry and exit; a code's kernels included), per saved
tensor, timed afterwards by wrapping them. ``saved`` is what a step holds for backward, as a
share of stock's. ``py calls`` counts the Python functions a step enters (generators'
resumptions included), on the CPU: the host work a step does in the interpreter, counted
rather than timed, so the same on a busy machine. It is the figure that sets the engine's cost
on a CPU: inside a model, where each large op leaves the interpreter's code and objects out of
the caches, a Python call costs several times what it costs in a loop that keeps them warm
(:func:`cold_call_us`).
``--profile`` shows where a strategy's time goes (``cProfile``, by own time).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import functools
import io
import itertools
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from torch import Tensor, nn

from torchstash.testing.models import ZooEntry, zoo

from .common import (
    default_device,
    fmt,
    jsonable,
    key,
    num_threads,
    rows_table,
    share,
    split_names,
    timing_arguments,
)
from .compare_methods import CHECKPOINT, EMPTY_HOOKS, Attached, HeldCounter, Method, methods
from .turns import turns

#: what the table measures by default: nothing compressed (and under it, an empty Python
#: pack/unpack pair: the floor of any saved-tensor hook), the rewrites, the codes, and the
#: per-block checkpointing every strategy must beat
DEFAULT_METHODS = (
    EMPTY_HOOKS,
    "none",
    "memsave",
    "quant.int8",
    "quant.int4",
    "quant.int2",
    "quant.auto",
    "quant.fp8",
    "quant.mesa",
    CHECKPOINT,
)


class HostBound(nn.Module):
    """64 x ``Linear(32, 32)`` + GELU at batch 4: each op is a few microseconds of compute, so
    whatever Python runs per saved tensor is the step's cost."""

    def __init__(self, depth: int = 64, width: int = 32) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *(m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU()))
        )
        self.head = nn.Linear(width, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layers(x))


class SmallCNN(nn.Module):
    """Four conv-BN-ReLU stages (one strided) and a linear head, on 32x32 images."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        chans = [3, width, width, 2 * width, 2 * width]
        self.blocks = nn.Sequential(
            *(
                nn.Sequential(
                    nn.Conv2d(cin, cout, 3, 2 if i == 2 else 1, 1, bias=False),
                    nn.BatchNorm2d(cout),
                    nn.ReLU(inplace=True),
                )
                for i, (cin, cout) in enumerate(itertools.pairwise(chans))
            )
        )
        self.head = nn.Linear(chans[-1], 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(x).mean((2, 3)))


class PreNormBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class SpeedGPT(nn.Module):
    """A 3-block pre-norm GPT with SDPA (width 512, context 128)."""

    def __init__(self, vocab: int = 256, dim: int = 512, layers: int = 3, heads: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, 128, dim))
        self.blocks = nn.ModuleList(PreNormBlock(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.embed(idx) + self.pos[:, : idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@dataclass(frozen=True)
class SpeedModel:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.device], tuple[Tensor, Tensor]]
    #: timed steps per method (each method runs this many steps, taking turns)
    steps: int

    def loss(self, out: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _classes(shape: tuple[int, ...], n: int) -> Callable[[torch.device], tuple[Tensor, Tensor]]:
    def batch(device: torch.device) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(shape, generator=g).to(device)
        return x, torch.randint(0, n, (shape[0],), generator=g).to(device)

    return batch


def _tokens(device: torch.device) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (2, 129), generator=g).to(device)
    return idx[:, :-1], idx[:, 1:]


def _short_tokens(device: torch.device) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (1, 33), generator=g).to(device)
    return idx[:, :-1], idx[:, 1:]


def _host_gpt() -> nn.Module:
    """``gpt-host``: the GPT at width 64, context 32, batch 1, its saves just over
    ``min_bytes``: kernels cost next to nothing, so its step is the host's work, as a GPU
    step on a model of a few milliseconds is (the codes cost 4.2x here and 3.5x on an H200's
    ``gpt-sdpa``; docs/gpu.md)."""
    return SpeedGPT(dim=64, heads=4)


MODELS = (
    SpeedModel("mlp-host", HostBound, _classes((4, 32), 10), 300),
    SpeedModel("cnn-small", SmallCNN, _classes((8, 3, 32, 32), 10), 60),
    SpeedModel("gpt-sdpa", SpeedGPT, _tokens, 30),
    SpeedModel("gpt-host", _host_gpt, _short_tokens, 200),
)


def zoo_models(scale: str) -> tuple[SpeedModel, ...]:
    """The bench zoo's models (``zoo-gpt``, ``zoo-vit``, ``zoo-resnet``) at ``scale``: where
    the README's other tables were measured."""
    out = []
    for z in zoo(scale):

        def batch(device: torch.device, z: ZooEntry = z) -> tuple[Tensor, Tensor]:
            return z.batch(z.batch_size, device)

        out.append(SpeedModel(f"zoo-{z.name}", z.build, batch, 40))
    return tuple(out)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stock_saves(model: nn.Module, x: Tensor, y: Tensor, entry: SpeedModel) -> int:
    """How many tensors stock PyTorch saves in one forward (each save, shared ones included)."""
    count = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = entry.loss(model(x), y)
    loss.backward()
    return count


@dataclass
class Run:
    method: Method
    attached: Attached | None = None
    times: list[float] | None = None
    error: str | None = None
    held: int | None = None


def measure_model(
    entry: SpeedModel,
    names: Sequence[str],
    device: torch.device,
    *,
    warmup: int = 20,
    steps: int | None = None,
    profile: int = 0,
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Rows for ``entry`` under stock and each of ``names``, and with ``profile`` steps the
    ``cProfile`` listing of each torchstash method."""
    torch.manual_seed(0)
    base = entry.build().to(device)
    x, y = entry.batch(device)
    n_saves = stock_saves(base, x, y, entry)
    runs = [Run(m) for m in methods(list(names))]
    for run in runs:
        try:
            run.attached = run.method.attach(copy.deepcopy(base))
        except Exception as e:  # a method that cannot take this model (no blocks to checkpoint)
            run.error = f"{type(e).__name__}: {e}"

    def step(run: Run, counter: HeldCounter | None = None) -> None:
        att = run.attached
        assert att is not None
        att.model.zero_grad(set_to_none=True)
        entry.loss(att.forward(x, counter), y).backward()

    live = [r for r in runs if r.error is None]
    for run in live:
        try:
            for _ in range(warmup):
                step(run)
            assert run.attached is not None
            counter = HeldCounter(run.attached.model, device)
            step(run, counter)
            run.held = sum(run.attached.held(counter))
            run.times = []
        except Exception as e:
            run.error = f"{type(e).__name__}: {e}"
    live = [r for r in runs if r.error is None]
    for run, timed in turns(live, steps or entry.steps):  # shuffled rounds, blocks of steps
        _sync(device)
        t0 = time.perf_counter()
        step(run)
        _sync(device)
        if timed:
            assert run.times is not None
            run.times.append(time.perf_counter() - t0)
    engine_us: dict[str, float] = {}
    calls: dict[str, float] = {}
    for run in live:
        if device.type == "cpu":  # a CUDA backward runs on autograd's device thread: uncounted
            calls[run.method.name] = python_calls(functools.partial(step, run))
        engine = _engine_of(run.attached)
        if engine is not None:
            one = functools.partial(step, run)
            spent = _engine_time(engine, one, max(5, (steps or entry.steps) // 3))
            engine_us[run.method.name] = spent * 1e6 / n_saves
    profiles: dict[str, str] = {}
    if profile:
        for run in live:
            if run.method.family != "torchstash":
                continue
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(profile):
                step(run)
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
            profiles[f"{entry.name} {run.method.name}"] = out.getvalue()
    stock = runs[0]
    assert stock.times, f"stock failed on {entry.name}: {stock.error}"
    stock_ms = statistics.median(stock.times) * 1e3
    stock_mean = statistics.fmean(stock.times) * 1e3
    rows = []
    for run in runs:
        if run.attached is not None:
            run.attached.close()
        ms = statistics.median(run.times) * 1e3 if run.times else None
        rows.append(
            {
                "model": entry.name,
                "method": run.method.name,
                "step_ms": ms,
                "ratio": ms / stock_ms if ms is not None else None,
                "mean_ratio": statistics.fmean(run.times) * 1e3 / stock_mean if run.times else None,
                "us_per_saved": (ms - stock_ms) * 1e3 / n_saves if ms is not None else None,
                "engine_us_per_saved": engine_us.get(run.method.name),
                "python_calls": calls.get(run.method.name),
                "saves": n_saves,
                "held_bytes": run.held,
                "held_share": run.held / stock.held
                if run.held is not None and stock.held
                else None,
                "error": run.error,
            }
        )
    return rows, profiles


def python_calls(step: Callable[[], None], steps: int = 3) -> float:
    """Python functions a call of ``step`` enters on this thread (median over ``steps``; a
    generator resumed counts as entered), with ``sys.setprofile``: an exact count where a
    timing would be noise. A profile function set before is put back."""
    entered = [0]

    def count(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            entered[0] += 1

    before = sys.getprofile()
    counts = []
    try:
        for _ in range(steps):
            entered[0] = 0
            sys.setprofile(count)
            try:
                step()
            finally:
                sys.setprofile(before)
            counts.append(entered[0])
    finally:
        sys.setprofile(before)
    return statistics.median(counts)


def cold_call_us(repeat: int = 50, evict_bytes: int = 8 << 20) -> tuple[float, float]:
    """Microseconds (median) of one small Python function, the engine's module-entry guard in
    miniature: ``(warm, cold)``, called twice in a row and called after a pass over
    ``evict_bytes`` of fresh memory (what a model's large op does to the caches between two
    saves). The ratio of the two is what a Python call costs in a model over what it costs in
    a microbenchmark."""
    state: dict[str, list[Any]] = {"frames": []}

    def guard(owner: nn.Module, args: tuple[Any, ...]) -> None:
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return
        first = args[0] if args else None
        shape = first.shape if isinstance(first, Tensor) else None
        state["frames"].append((owner, shape, owner.training))
        state["frames"].pop()

    owner, args = nn.Identity(), (torch.zeros(4),)
    warm, cold = [], []
    for _ in range(repeat):
        torch.empty(evict_bytes // 4).fill_(1.0)
        t0 = time.perf_counter()
        guard(owner, args)
        t1 = time.perf_counter()
        guard(owner, args)
        t2 = time.perf_counter()
        cold.append(t1 - t0)
        warm.append(t2 - t1)
    return statistics.median(warm) * 1e6, statistics.median(cold) * 1e6


def _engine_of(attached: Attached | None) -> Any:
    """The torchstash engine a method runs (None for stock and torch's own methods)."""
    while attached is not None:
        handle = getattr(attached, "handle", None)
        if handle is not None:
            return handle.engine
        attached = getattr(attached, "stashed", None)
    return None


#: the engine's own work in a step: its hooks' bodies (a code's kernels included)
ENGINE_HOOKS = ("pack", "unpack", "enter_module", "exit_module")


def _engine_time(engine: Any, step: Callable[[], None], steps: int) -> float:
    """Seconds a step spends inside the engine's hooks (median over ``steps``), timed by
    wrapping each hook: the engine's work without the cost of calling into Python."""
    spent = [0.0]

    def timed(f: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return f(*args)
            finally:
                spent[0] += time.perf_counter() - t0

        return run

    for name in ENGINE_HOOKS:
        setattr(engine, name, timed(getattr(engine, name)))
    try:
        per_step = []
        for _ in range(steps):
            spent[0] = 0.0
            step()
            per_step.append(spent[0])
        return statistics.median(per_step)
    finally:
        for name in ENGINE_HOOKS:
            delattr(engine, name)


def speed_table(rows: Sequence[dict[str, Any]], title: str) -> Table:
    columns = [
        ("model", key("model")),
        ("method", key("method")),
        ("step ms", lambda r: fmt(r["step_ms"], ".2f")),
        ("x stock", lambda r: fmt(r["ratio"], ".2f", "x")),
        ("x mean", lambda r: fmt(r["mean_ratio"], ".2f", "x")),
        ("us/saved", lambda r: "-" if r["method"] == "stock" else fmt(r["us_per_saved"], ".1f")),
        ("engine us", lambda r: fmt(r["engine_us_per_saved"], ".1f")),
        ("py calls", lambda r: fmt(r.get("python_calls"), ".0f")),
        ("saved", share("held_share")),
    ]
    return rows_table(title, columns, rows, failed="error")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchstash_bench.speed",
        description="Step time of each strategy over stock's, and the engine's microseconds "
        "per saved tensor, on four models (methods take turns in one process).",
    )
    p.add_argument(
        "--models",
        type=split_names,
        default=None,
        help="mlp-host,cnn-small,gpt-sdpa,gpt-host (default) and zoo-gpt,zoo-vit,zoo-resnet",
    )
    p.add_argument("--scale", default="small", help="the zoo models' scale (default: small)")
    p.add_argument(
        "--strategies",
        type=split_names,
        default=None,
        help=f"methods to time beside stock (default: {','.join(DEFAULT_METHODS)})",
    )
    timing_arguments(p, threads=1, warmup=20, steps=None)
    p.add_argument(
        "--profile",
        type=int,
        nargs="?",
        const=50,
        default=0,
        metavar="STEPS",
        help="also profile each strategy for STEPS steps (default 50) and print where it goes",
    )
    p.add_argument("--json", metavar="PATH", default=None, help="also write the rows as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(highlight=False)
    device = torch.device(args.device) if args.device else default_device()
    everything = MODELS + zoo_models(args.scale)
    chosen = args.models or [m.name for m in MODELS]
    unknown = set(chosen) - {m.name for m in everything}
    if unknown:
        console.print(f"unknown models: {', '.join(sorted(unknown))}")
        return 2
    names = args.strategies or list(DEFAULT_METHODS)
    rows: list[dict[str, Any]] = []
    with num_threads(args.threads):
        for entry in everything:
            if entry.name not in chosen:
                continue
            got, profiles = measure_model(
                entry, names, device, warmup=args.warmup, steps=args.steps, profile=args.profile
            )
            rows += got
            for label, text in profiles.items():
                console.print(f"[bold]{escape(label)}[/bold]")
                console.print(escape(text), soft_wrap=True)
            if len(chosen) > 1:  # a run cut short keeps the models it finished
                console.print(speed_table(got, f"{entry.name}: done"))
                _write_json(args.json, rows)
    where = f"{device}, {args.threads} thread(s)" if device.type == "cpu" else str(device)
    console.print(speed_table(rows, f"torchstash speed on {where}: median step, turns taken"))
    console.print(
        "x stock = median step over stock's in this run; x mean = mean step over stock's "
        "(the steps that run now and then count); us/saved = (step - stock's step) / "
        "tensors stock saves per step; engine us = time inside the engine's hooks (its codes' "
        "kernels included) per saved tensor; py calls = Python functions a step enters (CPU); "
        "saved = bytes held for backward, share of stock's."
    )
    if device.type == "cpu":
        warm, cold = cold_call_us()
        console.print(
            f"A small Python function here: {warm:.1f} us called twice in a row, {cold:.1f} us "
            "after a pass over 8 MB (as between two saves in a model)."
        )
    _write_json(args.json, rows)
    return 1 if any(r["error"] and r["method"] != CHECKPOINT for r in rows) else 0


def _write_json(where: str | None, rows: list[dict[str, Any]]) -> None:
    if where:
        path = Path(where)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(jsonable(rows), indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
