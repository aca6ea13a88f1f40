"""``torchstash bench``: every zoo model under stock PyTorch and each installed strategy.

Each (model, strategy) pair gets a fresh model built from the same seed, so a strategy that
rewrites modules never leaks into another's run, and is measured by :func:`torchstash.measure`
(one warm-up step, then ``repeat`` timed steps). Stock's bytes are counted through the ``none``
strategy (the identity); stock's time is taken with no torchstash installed at all, so every
ratio includes torchstash's own overhead. ``none`` also gets a row of its own: that overhead.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from torchstash.measure import Report, measure, time_steps
from torchstash.testing.models import ZooEntry, zoo

from .common import (
    MB,
    STOCK,
    compressed_nothing,
    cpu_threads,
    default_device,
    error_text,
    fmt,
    lossless_of,
    merge_declined,
    num_threads,
    progress_bar,
    strategy_names,
    top_reason,
)

SCALES = ("tiny", "small", "base")
SEED = 0


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
        if device.type == "cuda":  # the next row's peak starts from the weights it builds
            gc.collect()
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
