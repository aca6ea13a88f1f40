"""``torchstash demo``: train a small char-level GPT, stock and under each installed strategy.

Everything is local, so the demo runs offline: the corpus is the Python standard library's own
source on this machine and the model is the zoo's GPT, built from a seed. Every run starts from
the same weights and sees the same batches, so the differences in loss, saved memory and step
time come from the strategy alone.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from torch import Tensor, nn

from ..api import Handle, PolicyLike, apply
from ..engine import Tally
from ..errors import PolicyError
from ..policy import as_policy, parse_spec
from .common import (
    MB,
    STOCK,
    compressed_nothing,
    cpu_threads,
    default_device,
    error_text,
    fmt,
    jsonable,
    lossless_of,
    merge_declined,
    num_threads,
    plural,
    progress_bar,
    split_names,
    strategy_names,
    top_reason,
)
from .zoo import GPT

VOCAB = 128  # ASCII; source files are almost entirely ASCII
UNK = 0  # every byte >= 128 maps here (NUL never occurs in source text)
SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
QUICK_STEPS = 12  # --quick caps the number of steps at this


@dataclass(frozen=True)
class DemoConfig:
    """Sizes of the model, data and schedule.

    The default takes about 20 s per 300-step run on one CPU thread (about 60 ms a step), so
    stock and a dozen strategies finish in about 5 minutes on a 2-core machine.
    """

    dim: int = 128
    layers: int = 4
    heads: int = 4
    ctx: int = 64
    batch: int = 12
    lr: float = 2e-3
    corpus_bytes: int = 3 << 20
    val_fraction: float = 0.1
    val_batches: int = 8
    log_every: int = 10
    tail: int = 20  # the final train loss is the mean of this many last steps
    timing_skip: int = 5  # first steps left out of the median step time

    @classmethod
    def quick(cls) -> DemoConfig:
        """A model and corpus small enough for tests: a few seconds in all."""
        return cls(
            dim=32,
            layers=1,
            heads=2,
            ctx=16,
            batch=4,
            corpus_bytes=64 << 10,
            val_batches=2,
            log_every=2,
            tail=4,
            timing_skip=1,
        )


# -- corpus ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    """Tokens (byte values, clipped to ASCII) of the standard library's source."""

    train: Tensor
    val: Tensor
    root: str
    files: int
    nbytes: int

    def info(self) -> dict[str, Any]:
        """Where the text came from and how it was split (for demo.json)."""
        return {
            "root": self.root,
            "files": self.files,
            "bytes": self.nbytes,
            "train_tokens": len(self.train),
            "val_tokens": len(self.val),
        }


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path) -> Iterator[Path]:
    """``.py`` files under ``root``, sorted (so deterministic), skipping tests and site-packages."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath, name)


def encode(data: bytes) -> Tensor:
    """Bytes to token ids: ASCII as is, anything else to :data:`UNK`."""
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
    ids[ids >= VOCAB] = UNK
    return ids


def load_corpus(max_bytes: int, val_fraction: float = 0.1, root: Path | None = None) -> Corpus:
    """Up to ``max_bytes`` of source; the last ``val_fraction`` of it is held out for validation."""
    root = root or stdlib_root()
    chunks: list[bytes] = []
    total = files = 0
    for path in stdlib_sources(root):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        files += 1
        if total >= max_bytes:
            break
    if total < 4096:
        raise RuntimeError(f"found only {total} bytes of Python source under {root}")
    ids = encode(b"".join(chunks))
    cut = int(len(ids) * (1 - val_fraction))
    return Corpus(ids[:cut], ids[cut:], str(root), files, total)


def windows(tokens: Tensor, starts: Tensor, ctx: int) -> tuple[Tensor, Tensor]:
    """Inputs and next-token targets for sequences starting at ``starts``."""
    seq = tokens[starts[:, None] + torch.arange(ctx + 1)]
    return seq[:, :-1], seq[:, 1:]


def train_starts(corpus: Corpus, cfg: DemoConfig, steps: int, seed: int) -> Tensor:
    """Every step's batch, drawn once from ``seed`` so that every run sees the same data."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, len(corpus.train) - cfg.ctx - 1, (steps, cfg.batch), generator=g)


def val_starts(corpus: Corpus, cfg: DemoConfig) -> Tensor:
    """Held-out sequences spread evenly over the validation slice."""
    n = cfg.val_batches * cfg.batch
    top = max(len(corpus.val) - cfg.ctx - 2, 0)
    return torch.linspace(0, top, n).long().view(cfg.val_batches, cfg.batch)


# -- one run --------------------------------------------------------------------------------


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


def build_model(cfg: DemoConfig, seed: int, device: torch.device) -> GPT:
    """The same initial weights for every run."""
    torch.manual_seed(seed)
    return GPT(VOCAB, cfg.ctx, cfg.dim, cfg.layers, cfg.heads).to(device)


def lm_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tally_into(run: RunResult, tally: Tally) -> None:
    """Copy one step's saved-tensor accounting into the run."""
    rows = list(tally.rows.values())
    run.raw_bytes = tally.raw_bytes
    run.stored_bytes = tally.stored_bytes
    run.host_bytes = sum(r.host_bytes for r in rows)
    run.compressed = sum(r.compressed for r in rows)
    run.declined = merge_declined(r.declined for r in rows)


def stock_tally(model: nn.Module, x: Tensor, y: Tensor) -> Tally:
    """What stock PyTorch saves in one step, counted by ``none`` (the identity) on a copy."""
    twin = copy.deepcopy(model)
    with apply(twin, "none") as h:
        lm_loss(twin, x, y).backward()
        return h.tally


@torch.no_grad()
def evaluate(model: nn.Module, tokens: Tensor, starts: Tensor, cfg: DemoConfig) -> float:
    """Mean loss on the fixed held-out batches."""
    device = next(model.parameters()).device
    losses = []
    for row in starts:
        x, y = windows(tokens, row, cfg.ctx)
        losses.append(lm_loss(model, x.to(device), y.to(device)).item())
    return sum(losses) / len(losses)


@dataclass(frozen=True)
class Setup:
    """What every run shares: config, data and schedule."""

    cfg: DemoConfig
    corpus: Corpus
    starts: Tensor
    val: Tensor
    steps: int
    seed: int
    device: torch.device
    #: runs defined by a policy rather than one strategy: label -> policy
    policies: Mapping[str, PolicyLike] = field(default_factory=dict)

    def apply(self, model: nn.Module, run: str) -> Handle:
        """Apply the run named ``run``: a policy's label, or a strategy with options
        (``dropit.mink:gamma=0.8``)."""
        if run in self.policies:
            return apply(model, policy=self.policies[run])
        name, options = parse_spec(run)
        return apply(model, name, **options)


def train(setup: Setup, strategy: str | None, advance: Callable[[], None]) -> RunResult:
    """Train one fresh model (stock when ``strategy`` is None); an exception becomes ``error``."""
    cfg, dev = setup.cfg, setup.device
    run = RunResult(
        strategy or STOCK,
        True if strategy is None else lossless_of(strategy.partition(":")[0]),
        log_every=cfg.log_every,
        tail=cfg.tail,
    )
    t_start = time.perf_counter()
    handle: Handle | None = None
    done = 0
    try:
        model = build_model(cfg, setup.seed, dev)
        handle = setup.apply(model, strategy) if strategy is not None else None
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
        times = []
        for i, starts in enumerate(setup.starts):
            x, y = (t.to(dev) for t in windows(setup.corpus.train, starts, cfg.ctx))
            if handle is not None and i == setup.steps - 1:
                handle.tally.reset()  # count exactly one step: the last
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(model, x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            run.losses.append(loss.item())
            _sync(dev)
            times.append(time.perf_counter() - t0)
            advance()
            done += 1
        _tally_into(run, handle.tally if handle is not None else stock_tally(model, x, y))
        run.rewritten = len(handle.rewrites) if handle is not None else 0
        run.val_loss = evaluate(model, setup.corpus.val, setup.val, cfg)
        timed = times[cfg.timing_skip :] or times
        run.step_ms = statistics.median(timed) * 1e3
        run.step_spread = spread(timed)
    except Exception as e:  # one strategy's failure must not stop the others
        run.error = error_text(e)
        for _ in range(setup.steps - done):
            advance()
    finally:
        if handle is not None:
            handle.remove()
    run.wall_s = time.perf_counter() - t_start
    return run


#: Above this spread of stock's step times (see :func:`spread`) the time column is marked as
#: unreliable: another process shared the cores (a quiet run here: 0.05-0.15).
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


def _header(setup: Setup, params: int, threads: int, names: Sequence[str]) -> str:
    c, cfg, dev = setup.corpus, setup.cfg, setup.device
    where = f"{dev} ({plural(threads, 'thread')})" if dev.type == "cpu" else str(dev)
    layers = plural(cfg.layers, "layer")
    return (
        f"[bold]torchstash demo[/bold]: char-level GPT ({layers}, dim {cfg.dim}, ctx {cfg.ctx}, "
        f"{params / 1e6:.2f}M params), AdamW, {setup.steps} steps of batch {cfg.batch}, "
        f"seed {setup.seed}, on [bold]{where}[/bold]\n"
        f"corpus: {c.nbytes / MB:.1f} MB of Python source from {c.files} files of this machine's "
        f"standard library ({escape(c.root)}); corpus and model are local, nothing is downloaded\n"
        f"runs: {STOCK}, {escape(', '.join(names)) or '(no strategy installed)'}"
        " (same initial weights, same batches)"
    )


def run_demo(
    steps: int = 300,
    out_dir: str | Path = "demo-out",
    strategies: Sequence[str] | None = None,
    seed: int = 0,
    quick: bool = False,
    console: Console | None = None,
    *,
    device: str | torch.device | None = None,
    threads: int | None = None,
    config: DemoConfig | None = None,
    policies: Mapping[str, PolicyLike] | None = None,
) -> DemoResult:
    """Train stock, then each strategy; print the table, write ``demo.json`` and ``demo.png``.

    ``strategies`` defaults to every installed one except ``none`` (which equals stock; name
    it explicitly to check that); a strategy may carry options (``dropit.mink:gamma=0.8``).
    ``policies`` adds runs each defined by a policy, under its label. ``quick`` uses a tiny model and corpus and at most
    :data:`QUICK_STEPS` steps. On CPU, ``threads`` defaults to :func:`bench.cpu_threads`.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    t0 = time.perf_counter()
    console = console or Console(highlight=False)
    cfg = config or (DemoConfig.quick() if quick else DemoConfig())
    steps = min(steps, QUICK_STEPS) if quick else steps
    cfg = replace(cfg, tail=min(cfg.tail, steps))
    dev = torch.device(device) if device is not None else default_device()
    names = strategy_names(strategies, keep_none=strategies is not None)
    names += [label for label in policies or {} if label not in names]
    threads = cpu_threads(threads) if dev.type == "cpu" else torch.get_num_threads()
    with num_threads(threads):
        corpus = load_corpus(cfg.corpus_bytes, cfg.val_fraction)
        setup = Setup(
            cfg,
            corpus,
            train_starts(corpus, cfg, steps, seed),
            val_starts(corpus, cfg),
            steps,
            seed,
            dev,
            dict(policies or {}),
        )
        params = sum(p.numel() for p in build_model(cfg, seed, dev).parameters())
        console.print(_header(setup, params, threads, names))
        runs = _train_all(setup, names, console)
    result = DemoResult(
        runs,
        cfg,
        steps,
        seed,
        str(dev),
        threads,
        corpus.info(),
        params,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    console.print(demo_table(result))
    result.png_path = save_plot(result, out / "demo.png", console)
    result.wall_s = time.perf_counter() - t0
    result.json_path = out / "demo.json"
    result.json_path.write_text(json.dumps(jsonable(result.to_dict()), indent=2) + "\n")
    _footer(result, console)
    return result


def _train_all(setup: Setup, names: Sequence[str], console: Console) -> list[RunResult]:
    """Every run, with a progress bar on a terminal and a line per finished run otherwise (a
    log, CI, ``| tee``: the bar draws nothing there, and the runs take minutes)."""
    runs: list[RunResult] = []
    total = 1 + len(names)
    with progress_bar(console) as bar:
        task = bar.add_task(STOCK, total=setup.steps * total)
        for i, name in enumerate([None, *names], 1):
            bar.update(task, description=escape(name or STOCK))
            run = train(setup, name, lambda: bar.advance(task))
            relate(run, runs[0] if runs else run)
            runs.append(run)
            if not console.is_terminal:
                console.print(f"[{i}/{total}] {escape(_progress_line(run))}", highlight=False)
    return runs


def _progress_line(run: RunResult) -> str:
    if run.error:
        return f"{run.strategy}: failed after {run.wall_s:.1f} s: {run.error}"
    return (
        f"{run.strategy}: {len(run.losses)} steps in {run.wall_s:.1f} s, "
        f"val loss {fmt(run.val_loss, '.4f')} ({fmt(run.delta_val_pct, '+.2f', '%')} vs stock)"
    )


# -- output ---------------------------------------------------------------------------------


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


def _footer(result: DemoResult, console: Console) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchstash demo",
        description="Train a char-level GPT on this machine's Python standard library, "
        "stock and under each installed strategy, and compare loss, memory and speed. "
        "Nothing is downloaded.",
    )
    p.add_argument("--steps", type=int, default=300, help="training steps per run (default: 300)")
    p.add_argument("--out", default="demo-out", help="folder for demo.json and demo.png")
    p.add_argument(
        "--strategies",
        type=split_names,
        default=None,
        help="comma-separated strategy names, each with options as name:key=value;key=value "
        "(default: every installed one but none)",
    )
    p.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="TOML",
        help="a policy file to run too, labelled by its name; may be repeated",
    )
    p.add_argument("--seed", type=int, default=0, help="weights and batches (default: 0)")
    p.add_argument("--quick", action="store_true", help="tiny model and corpus, a few steps")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: all cores but one, <= 4)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``torchstash demo``; the exit status is 1 when stock or any strategy's run failed (the
    table still shows every run, a failed one with its error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    policies: dict[str, PolicyLike] = {}
    for f in args.policy:  # read now: a bad file is a usage error, not a failed run
        try:
            policies[Path(f).stem] = as_policy(Path(f))
        except PolicyError as e:
            parser.error(str(e))
    result = run_demo(
        args.steps,
        args.out,
        args.strategies,
        args.seed,
        args.quick,
        device=args.device,
        threads=args.threads,
        policies=policies,
    )
    return 1 if result.stock.error or any(r.error for r in result.runs) else 0


if __name__ == "__main__":
    sys.exit(main())
