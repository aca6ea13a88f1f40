"""What a demo run gives (:class:`RunResult`), the whole demo (:class:`DemoResult`), and how
they are shown: the table, its footer and the plot of losses and saved memory."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .common import MB, STOCK, compressed_nothing, fmt, plural, top_reason
from .demo_task import DemoConfig


@dataclass
class RunResult:
    """One training run: its losses, what it saved for backward in one step, its speed."""

    strategy: str
    lossless: bool | None
    losses: list[float] = field(default_factory=list)
    log_every: int = 10
    tail: int = 20
    val_loss: float | None = None
    raw_bytes: int | None = None
    stored_bytes: int | None = None
    host_bytes: int | None = None
    compressed: int | None = None
    declined: dict[str, int] = field(default_factory=dict)
    step_ms: float | None = None
    #: (90th - 10th percentile) / median of the timed steps: how much they varied
    step_spread: float | None = None
    time_ratio: float | None = None
    delta_train_pct: float | None = None
    delta_val_pct: float | None = None
    wall_s: float = 0.0
    error: str | None = None
    rewritten: int = 0  # modules the strategy rewrote (memsave's layers)

    @property
    def train_loss(self) -> float | None:
        """Mean train loss of the last ``tail`` steps: one step's loss is too noisy to compare.

        None for a run that failed part-way: its last losses are not a final loss.
        """
        tail = [] if self.error else self.losses[-self.tail :]
        return sum(tail) / len(tail) if tail else None

    @property
    def curve(self) -> list[tuple[int, float]]:
        """(1, first loss), then (step, mean loss of the ``log_every`` steps ending there)."""
        out = [(1, self.losses[0])] if self.losses else []
        for end in range(self.log_every, len(self.losses) + 1, self.log_every):
            window = self.losses[end - self.log_every : end]
            out.append((end, sum(window) / len(window)))
        return out

    @property
    def saved_bytes(self) -> int | None:
        """Bytes kept on the training device (what offloading moved to the host excluded)."""
        if self.stored_bytes is None or self.host_bytes is None:
            return None
        return self.stored_bytes - self.host_bytes

    @property
    def ratio(self) -> float | None:
        """raw / saved: how many times less than stock this strategy keeps for backward."""
        if self.raw_bytes is None or self.saved_bytes is None:
            return None
        return self.raw_bytes / self.saved_bytes if self.saved_bytes else float("inf")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            train_loss=self.train_loss,
            curve=[list(p) for p in self.curve],
            saved_bytes=self.saved_bytes,
            saved_mb=None if self.saved_bytes is None else self.saved_bytes / MB,
            raw_mb=None if self.raw_bytes is None else self.raw_bytes / MB,
            ratio=self.ratio,
        )
        return d


UNRELIABLE_SPREAD = 0.3


def spread(times: Sequence[float]) -> float | None:
    """(90th - 10th percentile) / median of ``times``; None for fewer than 5."""
    if len(times) < 5:
        return None
    cuts = statistics.quantiles(times, n=10)
    median = statistics.median(times)
    return (cuts[-1] - cuts[0]) / median if median > 0 else None


def times_unreliable(result: DemoResult) -> str | None:
    """Why the time column says little, or None: stock's own steps varied a lot."""
    s = result.stock.step_spread
    if s is not None and s > UNRELIABLE_SPREAD:
        return (
            f"stock's step times varied by {100 * s:.0f}% of their median (10th to 90th "
            "percentile): the machine was busy, so the time column is unreliable (marked ?); "
            "rerun on an idle machine for speed"
        )
    return None


def relate(run: RunResult, stock: RunResult) -> None:
    """Step time, memory and losses relative to stock's, measured in the same process (the
    same batch at the counted step: stock's bytes are the baseline even for a strategy that
    rewrites modules and so changes what the model saves)."""
    if run.raw_bytes is not None and stock.raw_bytes is not None:
        run.raw_bytes = stock.raw_bytes
    if run.step_ms is not None and stock.step_ms:
        run.time_ratio = run.step_ms / stock.step_ms
    if run.train_loss is not None and stock.train_loss:
        run.delta_train_pct = 100 * (run.train_loss - stock.train_loss) / stock.train_loss
    if run.val_loss is not None and stock.val_loss:
        run.delta_val_pct = 100 * (run.val_loss - stock.val_loss) / stock.val_loss


# -- the whole demo -------------------------------------------------------------------------


@dataclass
class DemoResult:
    """Every run of one demo, with where the figures went."""

    runs: list[RunResult]
    config: DemoConfig
    steps: int
    seed: int
    device: str
    threads: int
    corpus: dict[str, Any]
    params: int
    wall_s: float = 0.0
    json_path: Path | None = None
    png_path: Path | None = None

    @property
    def stock(self) -> RunResult:
        return self.runs[0]

    def run(self, strategy: str) -> RunResult:
        for r in self.runs:
            if r.strategy == strategy:
                return r
        raise KeyError(strategy)

    def to_dict(self) -> dict[str, Any]:
        return {
            "torch": torch.__version__,
            "device": self.device,
            "threads": self.threads,
            "steps": self.steps,
            "seed": self.seed,
            "params": self.params,
            "config": asdict(self.config),
            "corpus": self.corpus,
            "wall_s": self.wall_s,
            "runs": [r.to_dict() for r in self.runs],
        }


def _reason(run: RunResult) -> str | None:
    """Why a run failed or compressed nothing: printed under the table, which stays narrow."""
    if run.error:
        return f"failed: {run.error}"
    saved_some = (run.saved_bytes or 0) < (run.raw_bytes or 0)
    if compressed_nothing(run.strategy, run.compressed, run.host_bytes) and not saved_some:
        if run.rewritten:
            return f"rewrote {plural(run.rewritten, 'module')}, which keep what stock keeps here"
        return f"compressed nothing: {top_reason(run.declined)}"
    return None


def demo_table(result: DemoResult) -> Table:
    """Saved memory, speed and loss of every run next to stock's."""
    t = Table(title=f"torchstash demo: {result.steps} steps on {result.device}")
    t.add_column("strategy", no_wrap=True)
    for col in ("saved MB", "ratio", "time", "train loss", "val loss", "val vs stock"):
        t.add_column(col, justify="right", min_width=6)
    mark = "?" if times_unreliable(result) else ""
    for r in result.runs:
        t.add_row(
            escape(r.strategy) + (" [red](failed)[/red]" if r.error else ""),
            fmt(None if r.saved_bytes is None else r.saved_bytes / MB, ".2f"),
            fmt(r.ratio, ".2f", "x"),
            fmt(r.time_ratio, ".2f", "x" + mark),
            fmt(r.train_loss, ".4f"),
            fmt(r.val_loss, ".4f"),
            fmt(r.delta_val_pct, "+.2f", "%"),
        )
    return t


def footer(result: DemoResult, console: Console) -> None:
    for r in result.runs:
        reason = _reason(r)
        if reason:
            console.print(f"  {escape(r.strategy)}: {escape(reason)}")
    stock = result.stock
    raw = None if stock.raw_bytes is None else stock.raw_bytes / MB
    console.print(
        f"saved = what autograd kept for backward in one training step (stock: {fmt(raw)} MB); "
        f"ratio = stock's bytes / the strategy's; time = median step time / stock's "
        f"({fmt(stock.step_ms, '.1f')} ms) in this process; train loss = mean of the last "
        f"{result.config.tail} steps; val loss on {result.config.val_batches} held-out batches."
    )
    unreliable = times_unreliable(result)
    if unreliable:
        console.print(f"[yellow]{escape(unreliable)}[/yellow]")
    written = [p for p in (result.json_path, result.png_path) if p is not None]
    console.print(f"wrote {escape(', '.join(str(p) for p in written))}; took {result.wall_s:.1f} s")


#: 10 colours by 4 line styles: every run its own line, however many (the colour cycle alone
#: repeated from the 11th, and two strategies shared a colour)
_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf")  # fmt: skip
_DASHES = ("-", "--", "-.", ":")


def _line_style(i: int, strategy: str) -> dict[str, Any]:
    if strategy == STOCK:
        return {"color": "black", "linewidth": 2.2}
    k = i - 1
    return {
        "color": _COLOURS[k % len(_COLOURS)],
        "linestyle": _DASHES[(k // len(_COLOURS)) % len(_DASHES)],
        "linewidth": 1.2,
    }


def save_plot(result: DemoResult, path: Path, console: Console) -> Path | None:
    """Loss curves (left) and saved MB per strategy (right); skipped without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        console.print(
            escape("matplotlib is not installed, so no demo.png: pip install torchstash[plot]")
        )
        return None
    fig = Figure(figsize=(12, 4.8))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    ok = [r for r in result.runs if r.error is None]
    for i, r in enumerate(ok):
        steps, losses = zip(*r.curve) if r.curve else ((), ())
        left.plot(steps, losses, label=r.strategy, **_line_style(i, r.strategy))
    left.set(
        xlabel="step",
        ylabel=f"train loss (mean of {result.config.log_every} steps)",
        title="loss curves (same weights, same batches)",
    )
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    names = [r.strategy for r in ok]
    right.barh(names, [(r.raw_bytes or 0) / MB for r in ok], color="#dddddd")
    right.barh(names, [(r.saved_bytes or 0) / MB for r in ok], color="#1f77b4")
    mark = "?" if times_unreliable(result) else ""
    for i, r in enumerate(ok):
        label = (
            f" {fmt(r.step_ms, '.1f')} ms a step"
            if r.strategy == STOCK
            else f" {fmt(r.ratio, '.2f', 'x')} less, {fmt(r.time_ratio, '.2f', 'x' + mark)} time"
        )
        right.text((r.saved_bytes or 0) / MB, i, label, va="center", fontsize=8)
    right.invert_yaxis()
    right.set_xlim(0, max([(r.raw_bytes or 0) / MB for r in ok], default=1) * 1.6 or 1)
    right.set(
        xlabel="saved for backward in one step (MB); grey: stock",
        title="memory kept, step time vs stock" + (" (? busy machine)" if mark else ""),
    )
    fig.suptitle(f"torchstash demo: char-level GPT on {result.device}, {result.steps} steps")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


# -- command line ---------------------------------------------------------------------------
