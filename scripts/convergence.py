"""Convergence benchmark: stock PyTorch against every strategy on models the demo does not use.

Three models, each written here (not the zoo's or the demo's):

* ``gpt-sdpa``: a pre-norm char-level GPT (d=256, 4 layers, 4 heads, GELU MLP 4x, tied
  embedding and head, no biases) whose attention is ``F.scaled_dot_product_attention``;
* ``gpt-manual``: the same GPT with attention written out,
  ``softmax(q @ k.transpose(-2, -1) * scale + causal_mask) @ v``;
* ``cnn``: a small ResNet-like CNN (BatchNorm2d, ReLU, a depthwise conv, squeeze-excitation)
  classifying procedurally drawn noisy 32x32 textures generated here from a seed.

The GPTs read the demo's corpus (this machine's Python standard library, nothing downloaded)
with batch 8 of 128 characters. Every run of a model starts from the same weights and sees
the same batches; only the strategy differs. AdamW, lr 3e-3 (the GPTs: 30 steps of warmup,
then a cosine decay to a tenth; the CNN: a cosine decay to 0, as its BatchNorm statistics lag
a constant rate), 300 steps by default. A second stock run, its initial weights scaled by
1 + 1e-4 noise (``stock+noise``), shows how far "vs stock" moves for no strategy's fault.

Per (model, strategy) it reports the final validation loss and its difference from stock's in
percent, whether that meets the strategy's target (:data:`TARGETS`; lossless strategies must
stay within 0.1%, dropit and quant.int1 are reported only), the worst per-parameter gradient
cosine against stock at step 0 (same weights, same batch) and at stock's trained weights (the
end of its run, on a held-out batch: attention is peaked there, where a coded attention map
once gave ``q``'s and ``k``'s gradients cosines near 0 while step 0 read 0.99), and stock's
saved bytes over the strategy's for the last step.

    python scripts/convergence.py --threads 1 --json conv.json --markdown conv.md
    python scripts/convergence.py --models gpt-manual --strategies none,quant.int8 --steps 50
    python scripts/convergence.py --models gpt-manual,gpt-sdpa --probe-only
    python scripts/convergence.py --schedule constant --steps 200 --strategies quant.int2

``--check`` makes the exit status 1 when a strategy misses its target (or fails where it has
one). One line is printed per finished run, flushed, so a log is never silent for long.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from torch import Tensor

import torchstash
from torchstash.policy import parse_spec
from torchstash_bench.common import (
    cpu_threads,
    default_device,
    error_text,
    fmt,
    jsonable,
    num_threads,
    split_names,
)
from torchstash_bench.convergence_measures import (
    SETTLE_PASSES,
    ZERO_GRAD,
    Trained,
    evaluate,
    grad_cosines,
    gradients,
    stock_bytes,
    trained_cosines,
)
from torchstash_bench.convergence_runs import (
    LOSSLESS_PCT,
    TARGETS,
    Run,
    met_target,
    strategy_info,
    target_of,
)
from torchstash_bench.convergence_tasks import MODELS, Config, Task, make_task

STOCK = "stock"
#: stock again, its initial weights scaled by ``1 + 1e-4 * noise``: the noise floor of "vs stock"
NOISE = "stock+noise"
NOISE_SCALE = 1e-4
SCHEDULES = ("cosine", "constant")


# -- one run --------------------------------------------------------------------------------


def train(
    task: Task,
    strategy: str | None,
    steps: int,
    seed: int,
    cfg: Config,
    stock: Run | None = None,
    stock_grads: dict[str, Tensor] | None = None,
    trained: Trained | None = None,
    perturb: float = 0.0,
) -> tuple[Run, dict[str, Tensor], Trained | None]:
    """Train a fresh model (stock when ``strategy`` is None); returns the run and, for stock,
    its step-0 gradients and :class:`Trained`. An exception ends the run with ``error`` set.
    ``perturb``: stock with its initial weights scaled by ``1 + perturb * noise`` (the
    :data:`NOISE` run: how far a run moves for a change that is no strategy's fault)."""
    info = strategy_info()
    name = NOISE if perturb else (strategy or STOCK)
    lossless = True if strategy is None else info.get(parse_spec(strategy)[0], {}).get("lossless")
    run = Run(task.name, name)
    run.curve_every = cfg.curve_every
    if strategy is not None:
        run.lossless = None if lossless is None else bool(lossless)
        run.target_pct = target_of(strategy, run.lossless)
    grads0: dict[str, Tensor] = {}
    t_start = time.perf_counter()
    handle = None
    try:
        torch.manual_seed(seed)
        model = task.build().to(task.device)
        if perturb:
            g = torch.Generator().manual_seed(seed + 7)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1 + perturb * torch.randn(p.shape, generator=g).to(p.device))
        if strategy is None:
            run.raw_bytes = stock_bytes(task, model)
        else:
            spec, options = parse_spec(strategy)
            handle = torchstash.apply(model, spec, **options)
        opt = torch.optim.AdamW(model.parameters(), lr=task.lr, weight_decay=cfg.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: task.lr_factor(i, steps))
        torch.manual_seed(seed + 1)  # the same RNG stream for every run's training
        times = []
        for i in range(steps):
            x, y = task.batch(i)
            if handle is not None and i == steps - 1:
                handle.tally.reset()  # count exactly one step: the last
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = task.loss(model, x, y)
            loss.backward()
            if i == 0:
                if strategy is None:
                    grads0 = {
                        n: p.grad.detach().clone()
                        for n, p in model.named_parameters()
                        if p.grad is not None
                    }
                elif stock_grads is not None:
                    cos = grad_cosines(model, stock_grads)
                    run.worst_cos, run.worst_cos_param = cos.worst, cos.worst_param
                    run.whole_cos, run.cos_skipped = cos.whole, cos.skipped
            if cfg.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            opt.step()
            sched.step()
            run.losses.append(loss.item())
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
            times.append(time.perf_counter() - t0)
            if not math.isfinite(run.losses[-1]):
                raise FloatingPointError(f"loss is {run.losses[-1]} at step {i}")
        if handle is not None:
            rows = list(handle.tally.rows.values())
            run.stored_bytes = handle.tally.stored_bytes
            run.host_bytes = sum(r.host_bytes for r in rows)
            run.raw_bytes = stock.raw_bytes if stock is not None else handle.tally.raw_bytes
        else:
            run.stored_bytes = run.raw_bytes
            run.host_bytes = 0
        run.val_loss, run.val_acc = evaluate(task, model)
        run.step_ms = statistics.median(times[1:] or times) * 1e3
        if strategy is None and not perturb:
            x, y = task.val[0]
            model.train()
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            trained = Trained(state, gradients(task, model, x, y))
        elif trained is not None and strategy is not None:
            if handle is not None:
                handle.remove()
                handle = None
            cos = trained_cosines(task, strategy, trained, seed)
            run.trained_worst_cos, run.trained_worst_param = cos.worst, cos.worst_param
            run.trained_whole_cos = cos.whole
    except Exception as e:  # one strategy's failure must not stop the others
        run.error = error_text(e)
    finally:
        if handle is not None:
            handle.remove()
    run.wall_s = time.perf_counter() - t_start
    if stock is not None and run.val_loss is not None and stock.val_loss:
        run.rel_pct = 100 * (run.val_loss - stock.val_loss) / stock.val_loss
    run.met = met_target(run)
    return run, grads0, trained


# -- all runs -------------------------------------------------------------------------------


def default_strategies(include_presets: bool = False) -> list[str]:
    """Every registered strategy; presets (``quant`` and its ActNN levels ``quant.L0``-``L5``,
    which repeat other strategies' numerics) only when asked for."""
    return [s["name"] for s in torchstash.strategies() if include_presets or not s["preset"]]


def progress_line(run: Run) -> str:
    if run.strategy == STOCK:
        what = f"val {fmt(run.val_loss, '.4f')}"
        if run.val_acc is not None:
            what += f", acc {100 * run.val_acc:.1f}%"
    else:
        target = "report only" if run.target_pct is None else f"target {run.target_pct:g}%"
        verdict = {True: "met", False: "MISSED", None: ""}[run.met]
        what = (
            f"val {fmt(run.val_loss, '.4f')} ({fmt(run.rel_pct, '+.2f', '%')}; {target}"
            f"{': ' + verdict if verdict else ''}), worst grad cos {fmt(run.worst_cos, '.4f')} "
            f"({run.worst_cos_param}), whole {fmt(run.whole_cos, '.4f')}; trained: worst "
            f"{fmt(run.trained_worst_cos, '.4f')} ({run.trained_worst_param}), whole "
            f"{fmt(run.trained_whole_cos, '.4f')}; ratio {fmt(run.ratio, '.2f', 'x')}"
        )
    if run.error:
        what = f"FAILED: {run.error}"
    return f"[{run.model}] {run.strategy}: {what}; {run.wall_s:.1f} s"


def probe(task: Task, strategy: str, seed: int, grads0: dict[str, Tensor], trained: Trained) -> Run:
    """A strategy's gradient cosines only, at step 0 and at stock's trained weights: no
    training of its own (``--probe-only``)."""
    run = Run(task.name, strategy)
    t0 = time.perf_counter()
    try:
        torch.manual_seed(seed)
        model = task.build().to(task.device)
        spec, options = parse_spec(strategy)
        x, y = task.batch(0)
        with torchstash.apply(model, spec, **options):
            gradients(task, model, x, y)
        cos = grad_cosines(model, grads0)
        run.worst_cos, run.worst_cos_param, run.whole_cos = cos.worst, cos.worst_param, cos.whole
        cos = trained_cosines(task, strategy, trained, seed)
        run.trained_worst_cos, run.trained_worst_param = cos.worst, cos.worst_param
        run.trained_whole_cos = cos.whole
    except Exception as e:
        run.error = error_text(e)
    run.wall_s = time.perf_counter() - t0
    return run


def run_model(
    task: Task,
    strategies: Sequence[str],
    steps: int,
    seed: int,
    cfg: Config,
    probe_only: bool = False,
) -> list[Run]:
    stock, grads, trained = train(task, None, steps, seed, cfg)
    print(progress_line(stock), flush=True)
    runs = [stock]
    if not probe_only:
        noise, _, _ = train(task, None, steps, seed, cfg, stock, perturb=NOISE_SCALE)
        print(progress_line(noise), flush=True)
        runs.append(noise)
    for s in strategies:
        if probe_only and trained is not None:
            run = probe(task, s, seed, grads, trained)
        else:
            run, _, _ = train(task, s, steps, seed, cfg, stock, grads, trained)
        print(progress_line(run), flush=True)
        runs.append(run)
    return runs


def _met_text(run: Run) -> str:
    if run.strategy == STOCK:
        return ""
    if run.error and run.target_pct is None:
        return "failed"
    return {True: "yes", False: "NO", None: "report"}[run.met]


def _target_text(run: Run) -> str:
    if run.strategy == STOCK:
        return ""
    if run.target_pct is None:
        return "-"
    return f"±{run.target_pct:g}%" if run.lossless else f"≤{run.target_pct:g}%"


COLUMNS = (
    "model",
    "strategy",
    "val loss",
    "vs stock",
    "target",
    "met",
    "val acc",
    "worst grad cos",
    "whole cos",
    "trained worst",
    "trained whole",
    "ratio",
    "rise",
    "step ms",
)


def rows(runs: Sequence[Run]) -> list[list[str]]:
    out = []
    for r in runs:
        out.append(
            [
                r.model,
                r.strategy,
                fmt(r.val_loss, ".4f"),
                "" if r.strategy == STOCK else fmt(r.rel_pct, "+.2f", "%"),
                _target_text(r),
                _met_text(r),
                "" if r.val_acc is None else f"{100 * r.val_acc:.1f}%",
                "" if r.strategy == STOCK else fmt(r.worst_cos, ".4f"),
                "" if r.strategy == STOCK else fmt(r.whole_cos, ".4f"),
                "" if r.strategy == STOCK else fmt(r.trained_worst_cos, ".4f"),
                "" if r.strategy == STOCK else fmt(r.trained_whole_cos, ".4f"),
                fmt(r.ratio, ".2f", "x"),
                fmt(r.rise, ".3f"),
                fmt(r.step_ms, ".0f"),
            ]
        )
    return out


def table(runs: Sequence[Run], title: str) -> Table:
    t = Table(title=title)
    for c in COLUMNS:
        t.add_column(c, justify="left" if c in ("model", "strategy") else "right", no_wrap=True)
    for r, row in zip(runs, rows(runs)):
        style = "red" if r.met is False else None
        t.add_row(*(escape(c) for c in row), style=style)
    return t


def markdown(runs: Sequence[Run], header: str) -> str:
    lines = [header, "", "| " + " | ".join(COLUMNS) + " |"]
    lines.append("|" + "|".join("---" if c in ("model", "strategy") else "--:" for c in COLUMNS))
    lines[-1] += "|"
    for row in rows(runs):
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
    failed = [r for r in runs if r.error]
    if failed:
        lines.append("")
        lines += [f"- {r.model} / {r.strategy} failed: {r.error}" for r in failed]
    return "\n".join(lines) + "\n"


def _schedule_text(cfg: Config) -> str:
    if cfg.schedule == "constant":
        return f"GPTs: lr {cfg.lr:g}; CNN: {cfg.cnn_lr:g}; both constant, no warmup"
    return (
        f"GPTs: lr {cfg.lr:g}, {cfg.warmup} warmup steps, cosine decay to {cfg.min_lr:g}x; "
        f"CNN: {cfg.cnn_lr:g} with cosine decay"
    )


def legend(steps: int, cfg: Config) -> str:
    return (
        f"{steps} steps, AdamW ({_schedule_text(cfg)}), same weights and batches per "
        f"model. {NOISE} = stock with its initial weights scaled by 1 + {NOISE_SCALE:g} noise "
        "(the noise floor of vs stock). vs stock = final validation loss relative to stock's; "
        "target = the most it may "
        f"rise (lossless: within ±{LOSSLESS_PCT:g}% either way; '-' = reported only); worst grad "
        "cos = lowest per-parameter gradient cosine against stock at step 0 (same batch; "
        f"parameters whose stock gradient is zero up to rounding, norm <= {ZERO_GRAD:g} of the "
        "whole gradient's, left out); whole cos = the whole gradient's cosine; trained worst "
        "and trained whole = the same at stock's weights after its last step, on a held-out "
        f"batch (after {SETTLE_PASSES} passes over it, so running estimates and allocations "
        "settle); ratio = stock's saved bytes / the strategy's for one step; rise = most the "
        f"{cfg.curve_every}-step mean train loss climbed back above its lowest so far."
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models",
        type=split_names,
        default=list(MODELS),
        help=f"comma-separated, from {', '.join(MODELS)} (default: all)",
    )
    p.add_argument(
        "--strategies",
        type=split_names,
        default=None,
        help="comma-separated strategies, each with options as name:key=value;key=value; 'all' "
        "adds the presets (quant, quant.L0-L5) (default: every registered strategy but presets)",
    )
    p.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: cores-1, <=4)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    p.add_argument("--json", type=Path, default=None, help="write every run here")
    p.add_argument("--markdown", type=Path, default=None, help="write the table here")
    p.add_argument("--quick", action="store_true", help="tiny models and data (smoke test)")
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="cosine",
        help="learning rate: cosine (warmup then decay; the default) or constant (no warmup, "
        "no decay, as many users train)",
    )
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    p.add_argument(
        "--probe-only",
        action="store_true",
        help="train stock only; for each strategy just its gradient cosines (step 0 and at "
        "stock's trained weights): minutes, not an hour",
    )
    return p


def main(argv: Sequence[str] | None = None, console: Console | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    known = strategy_info()
    if args.strategies is None:
        strategies = default_strategies()
    elif args.strategies == ["all"]:
        strategies = default_strategies(include_presets=True)
    else:
        strategies = list(dict.fromkeys(args.strategies))
        missing = [s for s in strategies if parse_spec(s)[0] not in known]
        if missing:
            raise SystemExit(f"not registered: {', '.join(missing)}; see torchstash.strategies()")
    cfg = replace(Config.quick() if args.quick else Config(), schedule=args.schedule)
    device = torch.device(args.device) if args.device else default_device()
    threads = cpu_threads(args.threads) if device.type == "cpu" else torch.get_num_threads()
    with num_threads(threads):
        return _main(args, strategies, cfg, device, threads, console)


def _main(
    args: argparse.Namespace,
    strategies: list[str],
    cfg: Config,
    device: torch.device,
    threads: int,
    console: Console | None,
) -> int:
    # a log file gets the whole table, not one cut to 80 columns
    console = console or Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    t0 = time.perf_counter()
    print(
        f"convergence: {', '.join(args.models)} x stock + {', '.join(strategies)}; "
        f"{args.steps} steps on {device} ({threads} threads), torch {torch.__version__}",
        flush=True,
    )
    runs: list[Run] = []
    described: dict[str, str] = {}
    for m in args.models:
        task = make_task(m, cfg, args.steps, args.seed, device)
        described[m] = task.describe
        runs += run_model(task, strategies, args.steps, args.seed, cfg, args.probe_only)
    wall = time.perf_counter() - t0
    title = f"convergence: {args.steps} steps on {device}, {threads} threads"
    console.print(table(runs, title))
    console.print(escape(legend(args.steps, cfg)))
    for r in runs:
        if r.error:
            console.print(f"  {escape(r.model)} / {escape(r.strategy)}: {escape(r.error)}")
    missed = [r for r in runs if r.met is False]
    if args.json:
        data = {
            "torch": torch.__version__,
            "device": str(device),
            "threads": threads,
            "steps": args.steps,
            "seed": args.seed,
            "config": asdict(cfg),
            "models": described,
            "targets": TARGETS,
            "lossless_pct": LOSSLESS_PCT,
            "wall_s": wall,
            "missed": [f"{r.model}/{r.strategy}" for r in missed],
            "runs": [r.to_dict() for r in runs],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(jsonable(data), indent=2) + "\n")
    if args.markdown:
        header = "\n".join(
            [*(f"- {k}: {v}" for k, v in described.items()), "", legend(args.steps, cfg)]
        )
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(runs, header))
    verdict = (
        f"missed: {', '.join(f'{r.model}/{r.strategy}' for r in missed)}" if missed else "all met"
    )
    if args.probe_only:
        verdict = "not judged (--probe-only trains stock alone)"
    print(f"done in {wall:.0f} s; targets {verdict}", flush=True)
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
