"""``torchstash bench``: every zoo model under stock PyTorch and each installed strategy.

Each (model, strategy) pair gets a fresh model built from the same seed, so a strategy that
rewrites modules never leaks into another's run, and is measured by :func:`torchstash.measure`
(one warm-up step, then ``repeat`` timed steps). Stock's bytes are counted through the ``none``
strategy (the identity); stock's time is taken with no torchstash installed at all, so every
ratio includes torchstash's own overhead. ``none`` also gets a row of its own: that overhead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from .api import strategies as installed_strategies
from .measure import Report, measure, time_steps
from .zoo import ZooEntry, zoo

MB = 1 << 20
STOCK = "stock"
SCALES = ("tiny", "small", "base")
SEED = 0


# -- helpers the demo shares ----------------------------------------------------------------


def split_names(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``: the ``--strategies`` option's parser."""
    return [n.strip() for n in text.split(",") if n.strip()]


def strategy_names(requested: Iterable[str] | None, *, keep_none: bool = False) -> list[str]:
    """The strategies to run: as requested (deduplicated), or every installed one but presets.

    ``none`` stores what stock stores, so it is dropped unless ``keep_none``: the bench keeps
    it (its time is torchstash's own overhead); the demo keeps it only when asked for by name.
    """
    names = (
        [s["name"] for s in installed_strategies() if not s["preset"]]
        if requested is None
        else list(requested)
    )
    drop_none = not keep_none
    out: list[str] = []
    for n in names:
        if n not in out and not (n == "none" and drop_none):
            out.append(n)
    return out


def lossless_of(name: str) -> bool | None:
    """Whether an installed strategy is lossless (None when it is not installed)."""
    for s in installed_strategies():
        if s["name"] == name:
            return bool(s["lossless"])
    return None


def error_text(e: BaseException) -> str:
    """One line for a table cell and the JSON: the type and the first line of the message."""
    first = str(e).strip().splitlines()
    return f"{type(e).__name__}: {first[0]}" if first else type(e).__name__


def merge_declined(counts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Why tensors were left as they are, summed over modules: reason -> count."""
    total: Counter[str] = Counter()
    for c in counts:
        total.update(c)
    return dict(total)


def compressed_nothing(strategy: str, compressed: int | None, host_bytes: int | None) -> bool:
    """A strategy that packed no tensor and offloaded nothing: an identity on this model."""
    return strategy not in (STOCK, "none") and not compressed and not host_bytes


def top_reason(declined: Mapping[str, int]) -> str:
    """The most frequent reason a strategy gave for leaving tensors alone."""
    return max(declined, key=declined.__getitem__, default="nothing to compress")


def jsonable(value: Any) -> Any:
    """``value`` with NaN and infinities as null, so the output is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    """A number for a table cell; missing values show as a dash."""
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"  # e.g. everything offloaded: nothing left on the device
    return f"{value:{spec}}{suffix}"


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def progress_bar(console: Console) -> Progress:
    """The progress display both commands use."""
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cpu_threads(requested: int | None = None) -> int:
    """Threads for CPU runs: all cores but one, at most 4, unless ``requested``.

    Leaving a core free matters more than it seems: when another process keeps every core
    busy, a step whose OpenMP threads span all cores stalls for hundreds of milliseconds
    waiting for a descheduled thread, and the step-time ratios become noise. Models this
    small gain little beyond 4 threads.
    """
    if requested is not None:
        if requested < 1:
            raise ValueError(f"threads must be >= 1, got {requested}")
        return requested
    return max(1, min(4, (os.cpu_count() or 1) - 1))


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """``torch.set_num_threads(n)`` for a block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -- measuring ------------------------------------------------------------------------------


def _step_fn(entry: ZooEntry, model: torch.nn.Module, device: torch.device) -> Callable[[], None]:
    """Forward and backward on one fixed batch: what ``measure`` times and accounts."""
    inputs, targets = entry.batch(entry.batch_size, device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        entry.loss(model, inputs, targets).backward()

    return step


def _row(entry: ZooEntry, label: str, device: torch.device) -> dict[str, Any]:
    return {
        "model": entry.name,
        "strategy": label,
        "lossless": True if label == STOCK else lossless_of(label),
        "device": str(device),
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "batch_size": entry.batch_size,
        "raw_bytes": None,
        "stored_bytes": None,
        "host_bytes": None,
        "raw_mb": None,
        "saved_mb": None,
        "host_mb": None,
        "ratio": None,
        "step_ms": None,
        "step_times_ms": None,
        "time_ratio": None,
        "cuda_peak_mb": None,
        "compressed": None,
        "declined": None,
        "error": None,
    }


def _fill(row: dict[str, Any], report: Report) -> None:
    """Copy a report's figures into a row (saved = bytes kept on the tensors' own device)."""
    row.update(
        raw_bytes=report.raw_bytes,
        stored_bytes=report.stored_bytes,
        host_bytes=report.host_bytes,
        raw_mb=report.raw_bytes / MB,
        saved_mb=report.device_bytes / MB,
        host_mb=report.host_bytes / MB,
        ratio=report.raw_bytes / report.device_bytes if report.device_bytes else math.inf,
        step_ms=report.step_time_s * 1e3,
        cuda_peak_mb=None if report.cuda_peak_bytes is None else report.cuda_peak_bytes / MB,
        step_times_ms=[t * 1e3 for t in report.step_times_s],
        compressed=sum(r.compressed for r in report.rows),
        declined=merge_declined(r.declined for r in report.rows),
    )


def measure_one(
    entry: ZooEntry, strategy: str, device: torch.device, repeat: int, label: str | None = None
) -> dict[str, Any]:
    """One row: a fresh seeded model measured under ``strategy``; a failure becomes ``error``."""
    row = _row(entry, label or strategy, device)
    try:
        torch.manual_seed(SEED)
        model = entry.build().to(device)
        step = _step_fn(entry, model, device)
        report = measure(model, step, strategy, warmup=1, repeat=1 if label == STOCK else repeat)
        _fill(row, report)
        if label == STOCK:  # bytes through the identity; time with no torchstash at all
            times = time_steps(step, device, warmup=1, repeat=repeat)
            row["step_times_ms"] = [t * 1e3 for t in times]
            row["step_ms"] = statistics.median(times) * 1e3
    except Exception as e:  # one strategy's failure must not stop the others
        row["error"] = error_text(e)
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def warm_up(entry: ZooEntry, device: torch.device) -> None:
    """An untimed measurement on a throwaway model, so that stock (timed first) does not pay
    the process's first-call costs (hooks, op tracker, kernel selection) alone. A failure
    here shows again, recorded, in stock's own measurement."""
    with contextlib.suppress(Exception):
        torch.manual_seed(SEED)
        model = entry.build().to(device)
        measure(model, _step_fn(entry, model, device), "none", warmup=1, repeat=1)


def _relate(row: dict[str, Any], stock: dict[str, Any]) -> None:
    """Time and memory against stock's run: a strategy that rewrites modules (memsave)
    changes what the model saves, so the baseline is what stock saved, not the rewritten
    model's own raw count."""
    if row["step_ms"] is not None and stock["step_ms"]:
        row["time_ratio"] = row["step_ms"] / stock["step_ms"]
    if row["raw_bytes"] is not None and stock["raw_bytes"]:
        row["raw_bytes"] = stock["raw_bytes"]
        row["raw_mb"] = stock["raw_bytes"] / MB
        saved = row["stored_bytes"] - row["host_bytes"]
        row["ratio"] = stock["raw_bytes"] / saved if saved else math.inf


def run_bench(
    scale: str = "small",
    strategies: Sequence[str] | None = None,
    device: str | torch.device | None = None,
    repeat: int = 3,
    console: Console | None = None,
    *,
    threads: int | None = None,
) -> list[dict[str, Any]]:
    """Measure every zoo model at ``scale`` under stock and each strategy; one dict per pair.

    On CPU, ``threads`` defaults to :func:`cpu_threads`; torch's own setting is restored after.
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(SCALES)}, got {scale!r}")
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    dev = torch.device(device) if device is not None else default_device()
    names = strategy_names(strategies, keep_none=True)
    entries = zoo(scale)
    console = console or Console()
    n_threads = cpu_threads(threads) if dev.type == "cpu" else torch.get_num_threads()
    rows: list[dict[str, Any]] = []
    with num_threads(n_threads), progress_bar(console) as bar:
        task = bar.add_task("bench", total=len(entries) * (1 + len(names)))
        for entry in entries:
            bar.update(task, description=f"{entry.name}: {STOCK}")
            warm_up(entry, dev)
            stock = measure_one(entry, "none", dev, repeat, label=STOCK)
            _relate(stock, stock)
            rows.append(stock)
            bar.advance(task)
            for name in names:
                bar.update(task, description=f"{entry.name}: {escape(name)}")
                row = measure_one(entry, name, dev, repeat)
                _relate(row, stock)
                rows.append(row)
                bar.advance(task)
    return rows


# -- output ---------------------------------------------------------------------------------


def _flag(row: dict[str, Any]) -> str:
    """A marker after the strategy's name; :func:`bench_notes` gives the reason."""
    if row["error"]:
        return " [red](failed)[/red]"
    if compressed_nothing(row["strategy"], row["compressed"], row["host_bytes"]):
        return " [dim](declined)[/dim]"
    return ""


def bench_table(rows: Sequence[dict[str, Any]], title: str = "torchstash bench") -> Table:
    """Saved bytes, ratio and step time per model and strategy."""
    cuda = any(r["cuda_peak_mb"] is not None for r in rows)
    t = Table(title=title)
    t.add_column("model", no_wrap=True)
    t.add_column("strategy", no_wrap=True)
    for col in ("raw MB", "saved MB", "ratio", "step ms", "time"):
        t.add_column(col, justify="right")
    if cuda:
        t.add_column("CUDA peak MB", justify="right")
    for i, r in enumerate(rows):
        first = i == 0 or rows[i - 1]["model"] != r["model"]
        last = i == len(rows) - 1 or rows[i + 1]["model"] != r["model"]
        cells = [
            r["model"] if first else "",
            escape(r["strategy"]) + _flag(r),
            fmt(r["raw_mb"], ".2f"),
            fmt(r["saved_mb"], ".2f"),
            fmt(r["ratio"], ".2f", "x"),
            fmt(r["step_ms"], ".1f"),
            fmt(r["time_ratio"], ".2f", "x"),
        ]
        if cuda:
            cells.append(fmt(r["cuda_peak_mb"], ".1f"))
        t.add_row(*cells, end_section=last)
    return t


def bench_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Why a strategy failed or compressed nothing: one line per strategy and reason."""
    seen: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        if r["error"]:
            seen.setdefault((r["strategy"], f"failed: {r['error']}"), []).append(r["model"])
        elif _flag(r):
            why = f"compressed nothing: {top_reason(r['declined'])}"
            seen.setdefault((r["strategy"], why), []).append(r["model"])
    return [f"{name} ({', '.join(models)}) {why}" for (name, why), models in seen.items()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchstash bench",
        description="Measure saved-for-backward memory and step time of the model zoo "
        "under stock PyTorch and each installed strategy.",
    )
    p.add_argument("--scale", choices=SCALES, default="small", help="zoo size (default: small)")
    p.add_argument(
        "--strategies",
        type=split_names,
        default=None,
        help="comma-separated strategy names (default: every installed strategy)",
    )
    p.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    p.add_argument(
        "--repeat", type=int, default=None, help="timed steps per run (default: 3; --compare: 5)"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: all cores but one, <= 4)"
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="also write the rows as JSON to PATH; '-' prints JSON to stdout instead of the table",
    )
    c = p.add_argument_group(
        "--compare", "torchstash against checkpointing, SAC, save_on_cpu and torch.compile"
    )
    c.add_argument(
        "--compare",
        action="store_true",
        help="run stock, checkpoint, sac, save_on_cpu, compile-budget, the strategies and "
        "checkpoint+quant.int8 on the zoo and the demo task (--strategies may name any of "
        "them, and checkpoint+STRATEGY for any strategy)",
    )
    c.add_argument("--models", type=split_names, default=None, help="e.g. gpt,vit (default: all)")
    c.add_argument(
        "--demo-steps", type=int, default=300, help="demo training steps; 0 skips (default: 300)"
    )
    c.add_argument(
        "--budget", type=float, default=0.5, help="compile's activation_memory_budget (0.5)"
    )
    c.add_argument("--plot", metavar="PNG", default=None, help="write the Pareto plot to PNG")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``torchstash bench``: progress and table on the terminal, or JSON with ``--json``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compare:
        from . import compare

        return compare.main(args)
    if args.models or args.plot:
        parser.error("--models and --plot need --compare")
    args.repeat = args.repeat or 3
    to_stdout = args.json == "-"
    console = Console(stderr=True, highlight=False) if to_stdout else Console(highlight=False)
    dev = torch.device(args.device) if args.device else default_device()
    rows = run_bench(args.scale, args.strategies, dev, args.repeat, console, threads=args.threads)
    text = json.dumps(jsonable(rows), indent=2)
    if to_stdout:
        print(text)
        return 0
    where = f"{dev} ({plural(rows[0]['threads'], 'thread')})" if dev.type == "cpu" else str(dev)
    title = f"torchstash bench: zoo scale {args.scale} on {where}, median of {args.repeat} steps"
    console.print(bench_table(rows, title))
    for line in bench_notes(rows):
        console.print(f"  {escape(line)}")
    console.print(
        "saved = bytes autograd kept for backward on the device in one step; ratio = raw / saved; "
        "time = median step time relative to stock's in this run."
    )
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        console.print(f"wrote {escape(str(path))}")
    return 0
