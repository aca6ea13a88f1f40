"""Helpers the lab's tools share: strategy names, number formats, threads, progress bars."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
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

from torchstash.api import strategies as installed_strategies

MB = 1 << 20
STOCK = "stock"


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


#: a table column: its header and the cell it shows for a row
Column = tuple[str, Callable[[Mapping[str, Any]], str]]


def rows_table(
    title: str,
    columns: Sequence[Column],
    rows: Iterable[Mapping[str, Any]],
    *,
    left: int = 2,
    failed: str | None = None,
) -> Table:
    """One row per row, one column per ``(header, cell)``: the first ``left`` columns (the
    row's names) left-justified, the figures right. A row whose ``failed`` key is set shows
    that text (as text, never as markup: an error quotes brackets) in its last cell and
    dashes in the figures."""
    t = Table(title=title)
    for i, (header, _) in enumerate(columns):
        t.add_column(header, justify="left" if i < left else "right")
    for r in rows:
        why = r.get(failed) if failed else None
        if why:
            names = [cell(r) for _, cell in columns[:left]]
            t.add_row(*names, *["-"] * (len(columns) - left - 1), escape(str(why)[:60]))
        else:
            t.add_row(*(cell(r) for _, cell in columns))
    return t


def key(name: str, spec: str = "", suffix: str = "") -> Callable[[Mapping[str, Any]], str]:
    """The cell of column ``name``: the row's value formatted with ``spec``."""
    return lambda r: f"{r[name]:{spec}}{suffix}"


def share(name: str) -> Callable[[Mapping[str, Any]], str]:
    """The cell of a fraction ``name`` (of stock's), in percent; a dash where there is none."""
    return lambda r: "-" if r[name] is None else f"{100 * r[name]:.1f}%"


def megabytes(name: str) -> Callable[[Mapping[str, Any]], str]:
    """The cell of a byte count ``name``, in MB."""
    return lambda r: f"{r[name] / 1e6:.2f}"


def zoo_arguments(
    parser: argparse.ArgumentParser, strategies: Sequence[str] | None = None, hint: str = ""
) -> None:
    """``--scale`` of the zoo, ``--json``, and with ``strategies`` (the default list)
    ``--strategies``: the arguments every figure tool of the zoo takes."""
    parser.add_argument("--scale", default="small", choices=["tiny", "small", "base"])
    if strategies is not None:
        parser.add_argument(
            "--strategies",
            type=split_names,
            default=",".join(strategies),
            help=f"comma-separated; options as name:key=value;key=value{hint}",
        )
    parser.add_argument("--json", default=None, help="also write the rows to this file")


def timing_arguments(
    parser: argparse.ArgumentParser, *, threads: int | None, warmup: int, steps: int | None
) -> None:
    """``--device``, ``--threads``, ``--warmup`` and ``--steps``: the arguments of a tool that
    times training steps (``threads`` None: torch's own count)."""
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    threads_default = "torch's" if threads is None else str(threads)
    parser.add_argument(
        "--threads", type=int, default=threads, help=f"CPU threads (default: {threads_default})"
    )
    parser.add_argument(
        "--warmup", type=int, default=warmup, help=f"untimed steps first (default: {warmup})"
    )
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per method")


def write_rows(path: str | None, rows: Any) -> None:
    """The rows as JSON to ``path`` (the figure tools' ``--json``), when one is given."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=2)


def byte_counts(report: Any, prefix: str = "") -> dict[str, int]:
    """A report's stock and stored bytes as a row's ``<prefix>raw_bytes`` and
    ``<prefix>stored_bytes`` (the figure tools' fp32 and bf16 columns)."""
    return {f"{prefix}raw_bytes": report.raw_bytes, f"{prefix}stored_bytes": report.stored_bytes}
