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
- each torchstash strategy;
- ``checkpoint+<strategy>`` (default: ``checkpoint+quant.int8`` where installed): reentrant
  checkpointing around each repeated block, which keeps the blocks' inputs with
  ``save_for_backward``, and the strategy compressing them (and what the recomputed blocks save
  in backward). Non-reentrant checkpointing keeps those inputs out of reach of any saved-tensor
  hook's code, so the combination needs the reentrant form.

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
import contextlib
import functools
import json
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from torch import Tensor, nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ..api import Handle, apply
from ..measure import time_steps
from ..policy import parse_spec
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
    strategy_names,
    top_reason,
)
from .demo import (
    DemoConfig,
    build_model,
    evaluate,
    load_corpus,
    train_starts,
    val_starts,
    windows,
)
from .zoo import BasicBlock, Block, ZooEntry, zoo

CHECKPOINT, SAC, SAVE_ON_CPU, COMPILE = "checkpoint", "sac", "save_on_cpu", "compile-budget"
BASELINES = (CHECKPOINT, SAC, SAVE_ON_CPU, COMPILE)
#: checkpointing with a strategy on the blocks' inputs, run by default where the strategy is
#: installed (``checkpoint+<any strategy>`` may be named)
COMBINATIONS = (f"{CHECKPOINT}+quant.int8",)
BUDGET = 0.5
SEED = 0

# -- counting what is held for backward -----------------------------------------------------


def _storage_key(t: Tensor) -> tuple[int, str]:
    return t.untyped_storage().data_ptr(), str(t.device)


class HeldCounter:
    """Storages held for backward, each once at its full size, split by where they live.

    Parameters and buffers of ``model`` (and views of them) are left out: they exist whether
    or not anything is saved.
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        state = [*model.parameters(), *model.buffers()]
        self.skip = {_storage_key(t) for t in state}
        self.device = device
        self.held: dict[tuple[int, str], tuple[int, bool]] = {}

    def add(self, t: Tensor) -> Tensor:
        key = _storage_key(t)
        nbytes = t.untyped_storage().nbytes()
        if nbytes and key not in self.skip:
            self.held[key] = (nbytes, t.device.type == self.device.type)
        return t

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Count every tensor autograd saves while active (and keep it as is)."""
        return torch.autograd.graph.saved_tensors_hooks(self.add, _identity)

    @property
    def device_bytes(self) -> int:
        return sum(n for n, on_device in self.held.values() if on_device)

    @property
    def host_bytes(self) -> int:
        return sum(n for n, on_device in self.held.values() if not on_device)


def _identity(t: Tensor) -> Tensor:
    return t


# -- the methods ----------------------------------------------------------------------------


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The units checkpointing wraps: transformer blocks and ResNet basic blocks; in another
    model, the children of its longest ``ModuleList``/``Sequential``."""
    blocks = [m for m in model.modules() if isinstance(m, Block | BasicBlock)]
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList | nn.Sequential)]
    longest = max(lists, key=len, default=None)
    return list(longest) if longest is not None and len(longest) > 1 else []


class Attached:
    """A method on one model: ``forward`` runs the model under it, ``close`` undoes it."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.info: dict[str, Any] = {}

    def call(self, x: Tensor) -> Tensor:
        return cast(Tensor, self.model(x))

    def forward(self, x: Tensor, counter: HeldCounter | None = None) -> Tensor:
        """The model's output; with ``counter``, what the forward left for backward counted."""
        if counter is None:
            return self.call(x)
        with counter.hooks():
            return self.call(x)

    def held(self, counter: HeldCounter) -> tuple[int, int]:
        """(device bytes, host bytes) held for backward after ``forward(x, counter)``."""
        return counter.device_bytes, counter.host_bytes

    def close(self) -> None:
        pass

    def __enter__(self) -> Attached:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Checkpointed(Attached):
    """Each repeated block's forward through non-reentrant checkpointing; selective when
    ``selective``. Note: a BatchNorm inside a block updates its running statistics again
    when recomputed (the gradients are exact; the running averages move twice)."""

    def __init__(self, model: nn.Module, selective: bool = False, reentrant: bool = False) -> None:
        super().__init__(model)
        self.blocks = repeated_blocks(model)
        if not self.blocks:
            raise ValueError(f"{type(model).__name__} has no repeated blocks to checkpoint")
        self.caches: list[Any] = []
        kwargs: dict[str, Any] = {"use_reentrant": reentrant}
        if selective:
            kwargs["context_fn"] = self._contexts
        for blk in self.blocks:
            blk.forward = functools.partial(checkpoint, blk.forward, **kwargs)

    def _contexts(self) -> tuple[Any, Any]:
        caching, cached = create_selective_checkpoint_contexts(sac_policy)
        self.caches.append(caching)
        return caching, cached

    def forward(self, x: Tensor, counter: HeldCounter | None = None) -> Tensor:
        self.caches.clear()  # the previous step's; autograd has consumed them
        out = super().forward(x, counter)
        if counter is not None:
            for mode in self.caches:
                for t in _cached_tensors(mode.storage):
                    counter.add(t)
        return out

    def close(self) -> None:
        for blk in self.blocks:
            del blk.forward
        self.caches.clear()


#: ops whose outputs selective checkpointing keeps (the expensive ones); the rest is recomputed
SAC_SAVE = frozenset(
    getattr(torch.ops.aten, name)
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "convolution",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
)


def sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save matmuls and convolutions, recompute everything else."""
    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if packet in SAC_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _cached_tensors(obj: Any) -> Iterator[Tensor]:
    """Tensors in selective checkpointing's cache (dicts of wrappers with a ``val``)."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _cached_tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _cached_tensors(v)
    elif hasattr(obj, "val"):
        yield from _cached_tensors(obj.val)


class SavedOnCpu(Attached):
    """``save_on_cpu`` around the forward; with a counter, what its hook keeps is counted."""

    def __init__(self, model: nn.Module, pin_memory: bool) -> None:
        super().__init__(model)
        self.pin_memory = pin_memory

    def forward(self, x: Tensor, counter: HeldCounter | None = None) -> Tensor:
        hooks = torch.autograd.graph.save_on_cpu(pin_memory=self.pin_memory)
        if counter is None:
            with hooks:
                return self.call(x)
        pack = hooks.pack_hook

        def counted(t: Tensor) -> Any:
            packed = pack(t)
            counter.add(packed[1])
            return packed

        with torch.autograd.graph.saved_tensors_hooks(counted, hooks.unpack_hook):
            return self.call(x)


class Compiled(Attached):
    """``torch.compile(model)`` with the partitioner's activation memory budget set while
    the method is attached (it is read when a graph is compiled, at the first step)."""

    def __init__(self, model: nn.Module, budget: float) -> None:
        super().__init__(model)
        import torch._dynamo
        import torch._functorch.config as functorch_config

        self._stack = contextlib.ExitStack()
        self._stack.enter_context(functorch_config.patch(activation_memory_budget=budget))
        torch._dynamo.reset()
        try:
            self.compiled = torch.compile(model)
        except BaseException:
            self.close()
            raise

    def call(self, x: Tensor) -> Tensor:
        return cast(Tensor, self.compiled(x))

    def close(self) -> None:
        import torch._dynamo

        self._stack.close()
        torch._dynamo.reset()


class Stashed(Attached):
    """A torchstash strategy (``name:key=value`` options allowed): its tally counts."""

    def __init__(self, model: nn.Module, spec: str) -> None:
        super().__init__(model)
        name, options = parse_spec(spec)
        self.handle: Handle = apply(model, name, **options)

    def forward(self, x: Tensor, counter: HeldCounter | None = None) -> Tensor:
        if counter is not None:
            self.handle.tally.reset()
        return super().forward(x, counter)

    def held(self, counter: HeldCounter) -> tuple[int, int]:
        rows = list(self.handle.tally.rows.values())
        host = sum(r.host_bytes for r in rows)
        self.info = {
            "compressed": sum(r.compressed for r in rows),
            "declined": merge_declined(r.declined for r in rows),
            "rewritten": len(self.handle.rewrites),
        }
        return (
            self.handle.tally.stored_bytes - host + counter.device_bytes,
            host + counter.host_bytes,
        )

    def close(self) -> None:
        self.handle.remove()


class CheckpointedStash(Attached):
    """Reentrant checkpointing around each repeated block, and a torchstash strategy on what
    it keeps (the blocks' inputs, saved with ``save_for_backward``): the strategy's tally
    counts them."""

    def __init__(self, model: nn.Module, spec: str) -> None:
        super().__init__(model)
        self.checkpointed = Checkpointed(model, reentrant=True)
        try:
            self.stashed = Stashed(model, spec)
        except BaseException:
            self.checkpointed.close()
            raise

    def forward(self, x: Tensor, counter: HeldCounter | None = None) -> Tensor:
        return self.stashed.forward(x, counter)

    def held(self, counter: HeldCounter) -> tuple[int, int]:
        held = self.stashed.held(counter)
        self.info = self.stashed.info
        return held

    def close(self) -> None:
        self.stashed.close()
        self.checkpointed.close()


@dataclass(frozen=True)
class Method:
    """One row of the comparison: how to put it on a model."""

    name: str
    family: str  # "stock", "torch" or "torchstash"
    lossless: bool | None
    attach: Callable[[nn.Module], Attached]


def methods(
    names: Sequence[str] | None = None,
    *,
    budget: float = BUDGET,
    pin_memory: bool = False,
) -> list[Method]:
    """Stock, then the requested methods (default: every baseline and every installed
    strategy but presets and ``none``); a name not in :data:`BASELINES` is a strategy."""
    if names is None:
        installed = strategy_names(None)
        combined = [c for c in COMBINATIONS if c.partition("+")[2] in installed]
        names = [*BASELINES, *installed, *combined]
    out = [Method(STOCK, "stock", True, Attached)]
    for n in dict.fromkeys(names):
        if n == STOCK:
            continue
        if n == CHECKPOINT:
            out.append(Method(n, "torch", True, Checkpointed))
        elif n == SAC:
            out.append(Method(n, "torch", True, functools.partial(Checkpointed, selective=True)))
        elif n == SAVE_ON_CPU:
            out.append(
                Method(n, "torch", True, functools.partial(SavedOnCpu, pin_memory=pin_memory))
            )
        elif n == COMPILE:
            out.append(Method(n, "torch", False, functools.partial(Compiled, budget=budget)))
        elif n.startswith(f"{CHECKPOINT}+"):
            spec = n.partition("+")[2]
            lossless = lossless_of(spec.partition(":")[0])
            attach = functools.partial(CheckpointedStash, spec=spec)
            out.append(Method(n, "torchstash", lossless, attach))
        else:
            lossless = lossless_of(n.partition(":")[0])
            out.append(Method(n, "torchstash", lossless, functools.partial(Stashed, spec=n)))
    return out


# -- the zoo --------------------------------------------------------------------------------


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


@dataclass
class CompareResult:
    rows: list[dict[str, Any]]
    demo: list[dict[str, Any]]
    meta: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {**self.meta, "rows": self.rows, "demo": self.demo}


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
    return sorted(todo, key=lambda m: (m.name != STOCK, m.name == COMPILE))


def _relate_demo(run: dict[str, Any], stock: dict[str, Any]) -> None:
    if run["step_ms"] is not None and stock["step_ms"]:
        run["time_ratio"] = run["step_ms"] / stock["step_ms"]
    if run["val_loss"] is not None and stock["val_loss"]:
        run["delta_val_pct"] = 100 * (run["val_loss"] - stock["val_loss"]) / stock["val_loss"]


# -- output ---------------------------------------------------------------------------------


def _saved_cell(row: dict[str, Any]) -> str:
    if row["error"]:
        return "failed"
    pct = "" if row["vs_stock"] is None else f" ({100 * row['vs_stock']:.0f}%)"
    return f"{row['saved_mb']:.2f}{pct}"


def grid(result: CompareResult) -> tuple[list[str], list[list[str]], list[bool]]:
    """Header, one row of cells per method and where a family ends: per model, saved MB
    (share of stock's) and step time / stock's, on CUDA also peak MB; then the demo's final
    train and validation loss."""
    rows = result.rows
    models = list(dict.fromkeys(r["model"] for r in rows))
    names = list(dict.fromkeys(r["method"] for r in rows))
    cuda = any(r["cuda_peak_mb"] is not None for r in rows)
    demo = {d["method"]: d for d in result.demo}
    header = ["method"]
    for m in models:
        header += [f"{m} saved MB", f"{m} time"] + ([f"{m} peak MB"] if cuda else [])
    if demo:
        header += ["demo loss", "demo val loss"]
    by = {(r["model"], r["method"]): r for r in rows}
    cells: list[list[str]] = []
    ends: list[bool] = []
    for i, name in enumerate(names):
        line = [name]
        for m in models:
            r = by[(m, name)]
            line += [_saved_cell(r), fmt(r["time_ratio"], ".2f", "x")]
            if cuda:
                line.append(fmt(r["cuda_peak_mb"], ".1f"))
        if demo:
            d = demo.get(name, {})
            if d.get("error"):
                line += ["failed", "-"]
            else:
                line += [fmt(d.get("train_loss"), ".4f"), fmt(d.get("val_loss"), ".4f")]
        cells.append(line)
        family = by[(models[0], name)]["family"]
        ends.append(i + 1 < len(names) and by[(models[0], names[i + 1])]["family"] != family)
    return header, cells, ends


def compare_table(result: CompareResult, title: str = "torchstash bench --compare") -> Table:
    """The :func:`grid` as a rich table (failures in red)."""
    header, cells, ends = grid(result)
    t = Table(title=title)
    t.add_column(header[0], no_wrap=True)
    for h in header[1:]:
        t.add_column(h.replace(" ", "\n", 1), justify="right")
    for line, end in zip(cells, ends):
        styled = [escape(line[0])] + [
            "[red]failed[/red]" if c == "failed" else escape(c) for c in line[1:]
        ]
        t.add_row(*styled, end_section=end)
    return t


def markdown_table(result: CompareResult) -> str:
    """The :func:`grid` as a Markdown table (for the README)."""
    header, cells, _ = grid(result)
    out = ["| " + " | ".join(header) + " |", "|" + "---|" + "---:|" * (len(header) - 1)]
    out += ["| " + " | ".join(line) + " |" for line in cells]
    return "\n".join(out)


def compare_notes(result: CompareResult) -> list[str]:
    """Why a method failed or held what stock holds: one line per method and reason."""
    seen: dict[tuple[str, str], list[str]] = {}
    for r in result.rows:
        why = _note(r)
        if why:
            seen.setdefault((r["method"], why), []).append(r["model"])
    for d in result.demo:
        if d["error"]:
            seen.setdefault((d["method"], f"failed: {d['error']}"), []).append("demo")
    return [f"{name} ({', '.join(where)}): {why}" for (name, why), where in seen.items()]


def _note(r: dict[str, Any]) -> str | None:
    if r["error"]:
        return f"failed: {r['error']}"
    if r["method"] == SAVE_ON_CPU and r["host_bytes"] == 0:
        return (
            "the tensors already live on the host, so nothing moves "
            "(it saves device memory only on an accelerator)"
        )
    same = (r["vs_stock"] or 1.0) >= 0.999
    if r["family"] != "torchstash" or not same:
        return None
    if not compressed_nothing(r["method"], r["compressed"], r["host_bytes"]):
        return None
    if r.get("rewritten"):
        return f"rewrote {plural(r['rewritten'], 'module')}, which keep what stock keeps here"
    return f"compressed nothing: {top_reason(r['declined'] or {})}"


def _legend(result: CompareResult) -> str:
    m = result.meta
    demo = ""
    if m["demo_steps"]:
        c = m["demo_config"]
        demo = (
            f"; demo = the demo's char-level GPT (dim {c['dim']}, {plural(c['layers'], 'layer')}, "
            f"ctx {c['ctx']}, batch {c['batch']}) trained {m['demo_steps']} steps with each method "
            "from the same weights on the same batches: loss = mean of the last "
            f"{c['tail']} steps, val loss "
            "on held-out batches"
        )
    return (
        "saved MB = bytes held for backward after the forward (activations; parameters not "
        "counted), in parentheses the share of stock's; time = median step time / stock's in "
        f"this run (compile time excluded); compile-budget = torch.compile with "
        f"activation_memory_budget={m['budget']}{demo}."
    )


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats in both time and memory (lower is better), by time."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points):
        if not front or y < front[-1][1]:
            front.append((x, y))
    return front


def _label_groups(
    rows: Sequence[dict[str, Any]], near_x: float = 0.15, near_y: float = 0.035
) -> list[tuple[tuple[float, float], list[str], str]]:
    """Points whose labels would overlap (closer than ``near_x`` and ``near_y`` of the axes'
    spans: stock, offload.cpu and save_on_cpu sit on one spot on CPU) share one label, at
    the leftmost; grey when the families differ."""
    if not rows:
        return []
    rows = sorted(rows, key=lambda r: r["time_ratio"])
    xs = [r["time_ratio"] for r in rows]
    ys = [r["saved_mb"] for r in rows]
    dx, dy = near_x * ((max(xs) - min(xs)) or 1.0), near_y * ((max(ys) - min(ys)) or 1.0)
    groups: list[tuple[tuple[float, float], list[str], str]] = []
    for r, x, y in zip(rows, xs, ys):
        color = FAMILY_COLORS.get(r["family"], "grey")
        for i, ((gx, gy), names, gcolor) in enumerate(groups):
            if abs(x - gx) <= dx and abs(y - gy) <= dy:
                names.append(r["method"])
                groups[i] = ((gx, gy), names, gcolor if gcolor == color else "dimgrey")
                break
        else:
            groups.append(((x, y), [r["method"]], color))
    return groups


FAMILY_COLORS = {"stock": "black", "torch": "#d95f02", "torchstash": "#1b9e77"}


def save_plot(result: CompareResult, path: str | Path) -> Path:
    """Step time ratio against saved MB, one panel per model, the Pareto front dashed
    (needs matplotlib: ``pip install torchstash[plot]``)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    models = list(dict.fromkeys(r["model"] for r in result.rows))
    fig = Figure(figsize=(5.2 * len(models), 4.6))
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, model in zip(axes, models):
        ok = [
            r
            for r in result.rows
            if r["model"] == model and r["error"] is None and r["time_ratio"] is not None
        ]
        for r in ok:
            color = FAMILY_COLORS.get(r["family"], "grey")
            ax.scatter(r["time_ratio"], r["saved_mb"], color=color, s=22, zorder=3)
        for (x, y), names, color in _label_groups(ok):
            ax.annotate(
                ", ".join(names),
                (x, y),
                textcoords="offset points",
                xytext=(4, 3),
                fontsize=7,
                color=color,
            )
        front = pareto_front([(r["time_ratio"], r["saved_mb"]) for r in ok])
        if front:
            xs, ys = zip(*front)
            ax.step(xs, ys, where="post", linestyle="--", color="grey", linewidth=1, zorder=2)
        ax.set(title=model, xlabel="step time / stock's", ylabel="saved for backward (MB)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    handles = [
        Line2D([], [], marker="o", linestyle="", color=c, label=f) for f, c in FAMILY_COLORS.items()
    ]
    handles.append(Line2D([], [], linestyle="--", color="grey", label="Pareto front"))
    axes[0].legend(handles=handles, fontsize=7, loc="upper right")
    m = result.meta
    where = f"{m['device']} ({plural(m['threads'], 'thread')})" if m["threads"] else m["device"]
    fig.suptitle(f"torchstash bench --compare: zoo scale {m['scale']} on {where}")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


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
        console.print(_legend(result))
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


if __name__ == "__main__":  # python -m torchstash.bench.compare compare.json: the Markdown table
    import sys

    for arg in sys.argv[1:]:
        print(markdown_table(from_json(arg)))
