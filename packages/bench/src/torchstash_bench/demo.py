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
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.markup import escape
from torch import Tensor, nn

from torchstash.api import Handle, PolicyLike, apply
from torchstash.engine import Tally
from torchstash.errors import PolicyError
from torchstash.policy import as_policy, parse_spec
from torchstash.testing.models import GPT

from .common import (
    MB,
    STOCK,
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
)
from .demo_results import DemoResult, RunResult, demo_table, footer, relate, save_plot, spread
from .demo_task import (
    QUICK_STEPS,
    VOCAB,
    Corpus,
    DemoConfig,
    load_corpus,
    train_starts,
    val_starts,
    windows,
)

# -- one run --------------------------------------------------------------------------------


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
    footer(result, console)
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
