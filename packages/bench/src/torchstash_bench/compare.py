"""``torchstash bench --compare``: torchstash next to what users would otherwise reach for.

In one process, on the bench zoo and on the demo's training task, every method runs on a fresh
model built from the same seed:

- ``stock``: nothing changed;
- ``checkpoint``: ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` around
  each repeated block (transformer blocks, ResNet basic blocks);
- ``sac``: the same with selective activation checkpointing: matmul and convolution outputs
  are kept, everything else in the block is recomputed in backward;
- ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu`` (pinned on CUDA). On CPU the tensors
  already live on the host, so it moves nothing: it saves device memory only on an accelerator;
- ``compile-budget``: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget``
  (default 0.5): the partitioner recomputes what it must to keep that fraction of activations;
- ``compiled``: ``torch.compile(model)`` as it comes;
- each torchstash strategy;
- ``checkpoint+<strategy>`` (default: ``checkpoint+quant.int8`` where installed): reentrant
  checkpointing around each repeated block, which keeps the blocks' inputs with
  ``save_for_backward``, and the strategy compressing them (and what the recomputed blocks save
  in backward). Non-reentrant checkpointing keeps those inputs out of reach of any saved-tensor
  hook's code, so the combination needs the reentrant form;
- ``compiled+<strategy>`` (default: ``compiled+quant.int8``): the strategy applied, then
  ``torch.compile(model)``: its codes run inside the compiled graph where they trace
  (:mod:`torchstash.graphhooks`; the row's ``in_graph``), and its tally counts what the graph
  saves; a strategy that runs eagerly under compile (one warning) runs so here too.

What "saved" counts, the same way for every method: the bytes held for backward once the
model's forward has run (the loss's own saves left out, as torchstash's tally leaves them out).
A saved-tensor pack hook sees every tensor autograd keeps, compiled graphs' saves included, and
the block inputs non-reentrant checkpointing keeps; each storage is counted once at its full
size, parameters and buffers (and views of them) are not counted. Selective checkpointing keeps
its saved op outputs in its own cache rather than through autograd, so that cache is added.
For save_on_cpu the count is what its hook keeps and where (bytes on the host are not device
bytes). A torchstash strategy installs hooks of its own inside the model: its rows take the
tally's stored bytes (exact; what it offloaded to the host apart) plus anything the outer hook
still saw. The hook and torchstash's tally both count storages (a saved view counts the
storage it keeps alive), so on stock they agree exactly. Each row's share of stock's is
taken against stock counted its way all the same: the hook's count for the alternatives, the
tally of the ``none`` strategy (in the same stock run) for torchstash's rows.

On CUDA, "peak MB" is the counted step's peak allocation (``torch.cuda.max_memory_allocated``)
above what was allocated before it: the step's activations, gradients and temporaries, not the
models (the methods of one model are alive side by side, see :class:`Trial`).

Step time is the median of ``repeat`` forward-backward steps after warm-up (so the compile
time is left out), the methods of one model taking turns step by step, as a ratio to stock's.
The demo trains the demo's char-level GPT with each method (same weights, same batches) and
reports the final loss.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.markup import escape
from torch import Tensor, nn

from torchstash.api import apply
from torchstash.measure import time_steps
from torchstash.testing.models import ZooEntry, zoo

from .common import (
    MB,
    STOCK,
    cpu_threads,
    default_device,
    error_text,
    jsonable,
    num_threads,
    plural,
    progress_bar,
)
from .compare_methods import (
    BUDGET,
    COMPILE,
    COMPILED,
    SEED,
    Attached,
    HeldCounter,
    Method,
    methods,
)
from .compare_report import (
    CompareResult,
    compare_notes,
    compare_table,
    legend,
    markdown_table,
    save_plot,
)
from .demo import build_model, evaluate
from .demo_task import DemoConfig, load_corpus, train_starts, val_starts, windows


def _loss(entry: ZooEntry, run: Callable[[Tensor], Tensor], x: Tensor, y: Tensor) -> Tensor:
    """The zoo entry's loss with the model call going through the method."""
    return entry.loss(cast(nn.Module, run), x, y)


def _grads(model: nn.Module) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def grad_error(grads: Sequence[Tensor | None], ref: Sequence[Tensor | None]) -> float:
    """Relative error of all gradients together against stock's, ``|g - r| / |r|`` over every
    parameter at once (0.0: identical); inf when one has a gradient the other lacks."""
    diff = norm = 0.0
    for g, r in zip(grads, ref, strict=True):
        if g is None or r is None:
            if g is not r:
                return math.inf
            continue
        diff += (g.double() - r.double()).pow(2).sum().item()
        norm += r.double().pow(2).sum().item()
    return math.sqrt(diff / norm) if norm else math.sqrt(diff)


def _row(entry: ZooEntry, method: Method, device: torch.device) -> dict[str, Any]:
    return {
        "model": entry.name,
        "method": method.name,
        "family": method.family,
        "lossless": method.lossless,
        "device": str(device),
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "batch_size": entry.batch_size,
        "saved_bytes": None,
        "tally_bytes": None,
        "host_bytes": None,
        "saved_mb": None,
        "host_mb": None,
        "vs_stock": None,
        "step_ms": None,
        "step_times_ms": None,
        "time_ratio": None,
        "cuda_peak_mb": None,
        "grad_error": None,
        "compressed": None,
        "declined": None,
        "rewritten": None,
        #: a compiled strategy's codes ran in the graph (None: not a compiled strategy)
        "in_graph": None,
        "error": None,
    }


class Trial:
    """One method on a fresh seeded model of one zoo entry, measured in two parts.

    On creation: one warm-up step (compilation happens there), then one counted step (held
    bytes, CUDA peak, gradients). Then :meth:`step` times one step at a time, so the methods
    of one model can take turns: on a shared machine every method sees the same ups and downs
    of load, which one method's steps in a row would not. A failure at any point becomes the
    row's ``error`` and ends the trial.
    """

    def __init__(self, entry: ZooEntry, method: Method, device: torch.device) -> None:
        self.entry, self.method, self.device = entry, method, device
        self.row = _row(entry, method, device)
        self.grads: list[Tensor | None] | None = None
        self.times: list[float] = []
        self.att: Attached | None = None
        try:
            self._start()
        except Exception as e:  # one method's failure must not stop the others
            self.fail(e)

    def _start(self) -> None:
        entry, dev = self.entry, self.device
        torch.manual_seed(SEED)
        model = entry.build().to(dev)
        self.x, self.y = entry.batch(entry.batch_size, dev)
        if self.method.family == "stock":  # the baseline of torchstash's rows, counted its way
            with apply(model, "none") as handle:
                _loss(entry, model, self.x, self.y)
                self.row["tally_bytes"] = handle.tally.stored_bytes
        self.model = model
        self.att = att = self.method.attach(model)
        self._run()  # warm-up
        model.zero_grad(set_to_none=True)
        base = 0
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        counter = HeldCounter(model, dev)
        loss = _loss(entry, functools.partial(att.forward, counter=counter), self.x, self.y)
        held, host = att.held(counter)
        loss.backward()
        del loss
        if dev.type == "cuda":
            self.row["cuda_peak_mb"] = (torch.cuda.max_memory_allocated(dev) - base) / MB
        self.grads = _grads(self.model)
        self.row.update(
            saved_bytes=held,
            host_bytes=host,
            saved_mb=held / MB,
            host_mb=host / MB,
            compressed=att.info.get("compressed"),
            declined=att.info.get("declined"),
            rewritten=att.info.get("rewritten"),
            in_graph=att.info.get("in graph"),
        )

    def _run(self) -> None:
        assert self.att is not None
        self.model.zero_grad(set_to_none=True)
        _loss(self.entry, self.att.forward, self.x, self.y).backward()

    @property
    def alive(self) -> bool:
        return self.att is not None

    def step(self, timed: bool = True) -> None:
        """One forward and backward; its time kept when ``timed``."""
        if self.att is None:
            return
        try:
            self.times += time_steps(self._run, self.device, warmup=0, repeat=1) if timed else []
            if not timed:
                self._run()
        except Exception as e:
            self.fail(e)

    def fail(self, e: BaseException) -> None:
        self.row["error"] = _reason(e)
        self.close()

    def close(self) -> dict[str, Any]:
        """Undo the method; the row, with the median step time if it got that far."""
        if self.att is not None:
            self.att.close()
            self.att = None
        if self.times and self.row["error"] is None:
            self.row["step_times_ms"] = [t * 1e3 for t in self.times]
            self.row["step_ms"] = statistics.median(self.times) * 1e3
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return self.row


def measure_methods(
    entry: ZooEntry,
    todo: Sequence[Method],
    device: torch.device,
    repeat: int,
    advance: Callable[[str], None] = lambda name: None,
) -> list[Trial]:
    """Every method on ``entry``: counted one after another (stock first, compilation last),
    then timed in turns: an untimed round, then ``repeat`` timed rounds."""
    trials: dict[str, Trial] = {}
    for method in _measuring_order(todo):
        advance(method.name)
        trials[method.name] = Trial(entry, method, device)
    ordered = [trials[m.name] for m in todo]
    try:
        for r in range(repeat + 1):
            for trial in ordered:
                trial.step(timed=r > 0)
    finally:
        for trial in ordered:
            trial.close()
    return ordered


def measure_method(
    entry: ZooEntry, method: Method, device: torch.device, repeat: int
) -> tuple[dict[str, Any], list[Tensor | None] | None]:
    """One method alone: its row and the gradients of its counted step."""
    (trial,) = measure_methods(entry, [method], device, repeat)
    return trial.row, trial.grads


def _reason(e: BaseException) -> str:
    """The error's first line, and its cause's when it wraps one (compile errors do)."""
    text = error_text(e)
    cause = e.__cause__ or e.__context__
    return f"{text} (from {error_text(cause)})" if cause is not None else text


def _relate(row: dict[str, Any], stock: dict[str, Any]) -> None:
    if row["step_ms"] is not None and stock["step_ms"]:
        row["time_ratio"] = row["step_ms"] / stock["step_ms"]
    base = stock["tally_bytes"] if row["family"] == "torchstash" else stock["saved_bytes"]
    if row["saved_bytes"] is not None and base:
        row["vs_stock"] = row["saved_bytes"] / base


# -- the demo task --------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoTask:
    """The demo's model, corpus and batches, shared by every method's run."""

    cfg: DemoConfig
    steps: int
    seed: int
    device: torch.device
    corpus: Any = field(repr=False)
    starts: Tensor = field(repr=False)
    val: Tensor = field(repr=False)

    @classmethod
    def load(cls, cfg: DemoConfig, steps: int, seed: int, device: torch.device) -> DemoTask:
        cfg = replace(cfg, tail=min(cfg.tail, steps))
        corpus = load_corpus(cfg.corpus_bytes, cfg.val_fraction)
        starts = train_starts(corpus, cfg, steps, seed)
        return cls(cfg, steps, seed, device, corpus, starts, val_starts(corpus, cfg))


def train_demo(task: DemoTask, method: Method, advance: Callable[[], None]) -> dict[str, Any]:
    """Train the demo GPT with ``method``: final train loss (mean of the last ``tail`` steps),
    validation loss after training (method removed), median step time."""
    cfg, dev = task.cfg, task.device
    out: dict[str, Any] = {
        "method": method.name,
        "family": method.family,
        "train_loss": None,
        "val_loss": None,
        "delta_val_pct": None,
        "step_ms": None,
        "time_ratio": None,
        "error": None,
    }
    losses: list[float] = []
    done = 0
    try:
        model = build_model(cfg, task.seed, dev)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
        times = []
        with method.attach(model) as att:
            for starts in task.starts:
                x, y = (t.to(dev) for t in windows(task.corpus.train, starts, cfg.ctx))
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                logits = att.forward(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                losses.append(loss.item())
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - t0)
                advance()
                done += 1
        tail = losses[-cfg.tail :]
        out["train_loss"] = sum(tail) / len(tail)
        out["val_loss"] = evaluate(model, task.corpus.val, task.val, cfg)
        out["step_ms"] = statistics.median(times[cfg.timing_skip :] or times) * 1e3
    except Exception as e:
        out["error"] = _reason(e)
        for _ in range(task.steps - done):
            advance()
    out["losses"] = losses
    return out


# -- the whole comparison -------------------------------------------------------------------


def run_compare(
    models: Sequence[str] | None = None,
    scale: str = "small",
    names: Sequence[str] | None = None,
    device: str | torch.device | None = None,
    repeat: int = 5,
    demo_steps: int = 300,
    console: Console | None = None,
    *,
    threads: int | None = None,
    budget: float = BUDGET,
    demo_config: DemoConfig | None = None,
    seed: int = 0,
) -> CompareResult:
    """Every method on each zoo model at ``scale``, then on the demo task (``demo_steps`` 0
    skips it; ``demo_config`` defaults to the demo's own, or its quick one at tiny scale)."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if demo_steps < 0:
        raise ValueError(f"demo steps must be >= 0, got {demo_steps}")
    dev = torch.device(device) if device is not None else default_device()
    entries = zoo(scale)
    if models is not None:
        known = [e.name for e in entries]
        unknown = [m for m in models if m not in known]
        if unknown:
            raise ValueError(f"unknown models {unknown}; the zoo has {', '.join(known)}")
        entries = [e for e in entries if e.name in models]
    todo = methods(names, budget=budget, pin_memory=dev.type == "cuda")
    cfg = demo_config or (DemoConfig.quick() if scale == "tiny" else DemoConfig())
    console = console or Console(highlight=False)
    n_threads = cpu_threads(threads) if dev.type == "cpu" else torch.get_num_threads()
    rows: list[dict[str, Any]] = []
    demo: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with num_threads(n_threads), progress_bar(console) as bar:
        task = bar.add_task("compare", total=len(entries) * len(todo))
        for entry in entries:

            def advance(name: str, model: str = entry.name) -> None:
                bar.update(task, description=f"{model}: {escape(name)}")
                bar.advance(task)

            trials = measure_methods(entry, todo, dev, repeat, advance)
            stock = trials[0]
            for trial in trials:
                _relate(trial.row, stock.row)
                if trial.grads is not None and stock.grads is not None:
                    trial.row["grad_error"] = grad_error(trial.grads, stock.grads)
                rows.append(trial.row)
        if demo_steps:
            demo_task = DemoTask.load(cfg, demo_steps, seed, dev)
            task = bar.add_task("demo", total=demo_steps * len(todo))
            runs: dict[str, dict[str, Any]] = {}
            for method in _measuring_order(todo):
                bar.update(task, description=f"demo: {escape(method.name)}")
                run = train_demo(demo_task, method, lambda: bar.advance(task))
                _relate_demo(run, runs.get(STOCK, run))
                runs[method.name] = run
            demo = [runs[m.name] for m in todo]
    meta = {
        "torch": torch.__version__,
        "device": str(dev),
        "threads": n_threads if dev.type == "cpu" else None,
        "scale": scale,
        "repeat": repeat,
        "budget": budget,
        "demo_steps": demo_steps,
        "demo_config": {k: getattr(cfg, k) for k in ("dim", "layers", "ctx", "batch")}
        | {"tail": min(cfg.tail, demo_steps)},
        "seed": seed,
        "date": time.strftime("%Y-%m-%d"),
        "wall_s": time.perf_counter() - t0,
    }
    return CompareResult(rows, demo, meta)


def _measuring_order(todo: Sequence[Method]) -> list[Method]:
    """Stock first (the baseline), compilation last (the slowest to start)."""
    return sorted(todo, key=lambda m: (m.name != STOCK, _compiles(m.name)))


def _compiles(name: str) -> bool:
    return name in (COMPILE, COMPILED) or name.startswith(f"{COMPILED}+")


def _relate_demo(run: dict[str, Any], stock: dict[str, Any]) -> None:
    if run["step_ms"] is not None and stock["step_ms"]:
        run["time_ratio"] = run["step_ms"] / stock["step_ms"]
    if run["val_loss"] is not None and stock["val_loss"]:
        run["delta_val_pct"] = 100 * (run["val_loss"] - stock["val_loss"]) / stock["val_loss"]


# -- output ---------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    """``torchstash bench --compare`` (arguments parsed by the bench's parser)."""
    to_stdout = args.json == "-"
    console = Console(stderr=True, highlight=False) if to_stdout else Console(highlight=False)
    dev = torch.device(args.device) if args.device else default_device()
    try:
        result = run_compare(
            args.models,
            args.scale,
            args.strategies,
            dev,
            args.repeat or 5,
            args.demo_steps,
            console,
            threads=args.threads,
            budget=args.budget,
        )
    except ValueError as e:  # a bad model name, repeat or step count: a usage error
        console.print(f"torchstash bench --compare: error: {escape(str(e))}")
        return 2
    text = json.dumps(jsonable(result.to_dict()), indent=2)
    if to_stdout:
        print(text)
    else:
        m = result.meta
        where = f"{dev} ({plural(m['threads'], 'thread')})" if m["threads"] else str(dev)
        title = (
            f"torchstash bench --compare: zoo scale {args.scale} on {where}, "
            f"median of {m['repeat']} steps"
        )
        console.print(compare_table(result, title))
        for line in compare_notes(result):
            console.print(f"  {escape(line)}")
        console.print(legend(result))
    if args.json and not to_stdout:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        console.print(f"wrote {escape(str(path))}")
    if args.plot:
        try:
            console.print(f"wrote {escape(str(save_plot(result, args.plot)))}")
        except ImportError:
            console.print(
                escape("matplotlib is not installed, so no plot: pip install torchstash[plot]")
            )
    return 1 if any(r["error"] for r in result.rows) else 0  # a failed method fails the run


def from_json(path: str | Path) -> CompareResult:
    """A result written by ``--json``, read back (for :func:`markdown_table`)."""
    data = json.loads(Path(path).read_text())
    rows, demo = data.pop("rows"), data.pop("demo")
    return CompareResult(rows, demo, data)


if __name__ == "__main__":  # python -m torchstash_bench.compare compare.json: the Markdown table
    import sys

    for arg in sys.argv[1:]:
        print(markdown_table(from_json(arg)))
