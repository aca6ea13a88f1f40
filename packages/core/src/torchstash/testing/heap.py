"""A gauge of what autograd's graph holds that owes nothing to torchstash: glibc's heap.

torchstash counts what it keeps (a handle's :class:`~torchstash.engine.Tally`: ``raw_bytes``
for what stock PyTorch would hold, ``stored_bytes`` for what it holds); this gauge reads the
same from the outside. glibc's ``mallinfo2()`` reports ``uordblks`` (bytes of heap chunks in
use, every arena summed) and ``hblkhd`` (bytes of chunks it mapped on their own, as it does
for large CPU tensors); their sum is every byte malloc handed out and has not had back.
PyTorch's CPU allocator is ``posix_memalign`` with no cache, so a CPU tensor's storage is in
that sum from its allocation to its release.

What the graph holds is the heap with the graph alive less the heap once it is freed
(:func:`held_by_graph`). Parameters, and whatever the caller keeps (an input, the output), are
alive either way, so they are not in it: build the inputs inside ``forward`` and return only
the loss (:class:`WithLoss` puts a loss inside the model, where torchstash sees its saves).
Besides tensor bytes the figure holds the graph's nodes and saved-variable records
(:func:`graph_overhead` measures them, and :attr:`Reading.tensor_bytes` takes them off), a
few hundred bytes of ``TensorImpl`` and ``StorageImpl`` per tensor kept, and malloc's header
and rounding of each chunk: the tally's ``stored_bytes`` (payload) leaves those out, its
``held_bytes`` counts them (:class:`torchstash.packed.Allocation`), and is the figure to
compare on models whose saved tensors are a few kilobytes.

Conditions:

* glibc 2.33 or later (``mallinfo2``); elsewhere (macOS, musl, an ``LD_PRELOAD``-ed jemalloc
  or tcmalloc) :func:`available` is False and :func:`why_unavailable` says why;
* tensors on CPU (an accelerator's memory is not malloc's; pinned host memory is CUDA's);
* one thread, ``torch.set_num_threads(1)`` (:func:`read` sets it for the reading): intra-op
  worker threads keep freed chunks in caches of their own;
* ``MALLOC_ARENA_MAX=1`` set before the process starts (glibc reads it at its first
  allocation) for one arena. :func:`run_isolated` reads in a fresh interpreter started so
  (about 4 s, nearly all of it importing torch and the plug-ins); since ``mallinfo2`` sums
  the arenas and one thread allocates, a reading in a process without it agrees with one in
  such an interpreter (within 0.5%: the core's test_heap.py checks it), so tests read in-process.

``python -m torchstash.testing.heap [--scale N]`` prints the table of library against heap
figures on the models of :func:`cases` (see :func:`table`).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: The environment :func:`run_isolated` starts its interpreter with.
ISOLATED_ENV = {"MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _load() -> tuple[Callable[[], _Mallinfo2] | None, str]:
    try:
        libc = ctypes.CDLL(None)
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None, "no glibc mallinfo2() in this process (glibc 2.33 or later is needed)"
    fn.restype = _Mallinfo2
    fn.argtypes = []
    return fn, ""


_MALLINFO2, _WHY = _load()
_STATM = "/proc/self/statm"
_PROBED: str | None = None


def why_unavailable() -> str:
    """Why the gauge cannot read this process's heap ("" when it can)."""
    global _PROBED
    if _MALLINFO2 is None:
        return _WHY
    if _PROBED is None:
        # Another allocator (jemalloc, tcmalloc through LD_PRELOAD) serves malloc while glibc's
        # mallinfo2 still answers, for an arena nobody uses: a 4 MiB tensor must show up.
        gc.collect()
        before = heap_bytes()
        probe = torch.empty(1 << 22, dtype=torch.uint8)
        grew = heap_bytes() - before
        del probe
        _PROBED = (
            ""
            if (1 << 22) <= grew < (1 << 22) + (1 << 16)
            else f"a 4 MiB tensor moved mallinfo2's bytes in use by {grew}: malloc is not glibc's"
        )
    return _PROBED


def available() -> bool:
    """Whether :func:`heap_bytes` reads this process's malloc."""
    return not why_unavailable()


def heap_bytes() -> int:
    """Bytes malloc has handed out and not had back: ``uordblks + hblkhd``."""
    if _MALLINFO2 is None:
        raise RuntimeError(f"torchstash.testing.heap: {_WHY}")
    info = _MALLINFO2()
    return int(info.uordblks) + int(info.hblkhd)


def rss_readable() -> bool:
    """Whether :func:`rss_bytes` can read this process's resident set (Linux's ``/proc``)."""
    return os.path.exists(_STATM)


def rss_bytes() -> int:
    """Bytes of this process's resident set: what malloc keeps from the system besides what it
    has handed out (pages a fragmented heap cannot give back show here, not in
    :func:`heap_bytes`)."""
    with open(_STATM) as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def held_by_graph(forward: Callable[[], object]) -> int:
    """Bytes that what ``forward()`` returns (a loss) holds: the heap while it is alive less
    the heap once it is freed. What else is alive either way is not counted.

    The collector is off meanwhile, and the cycles the forward makes are collected from the
    young generations alone: older garbage stays put on both reads (a full collection takes a
    fifth of a second with torch loaded, longer than these forwards)."""
    gc.collect(1)
    enabled = gc.isenabled()
    gc.disable()
    try:
        out = forward()
        gc.collect(1)
        alive = heap_bytes()
        del out
        gc.collect(1)
        return alive - heap_bytes()
    finally:
        if enabled:
            gc.enable()


def _keep_nothing(t: Tensor) -> None:
    return None


def _never(packed: object) -> Tensor:
    raise RuntimeError("torchstash.testing.heap: a graph read by graph_overhead has no backward")


def graph_overhead(forward: Callable[[], object]) -> int:
    """Bytes the graph of ``forward()`` holds besides the saved tensors: its nodes, their
    saved-variable records and hooks, measured with every saved tensor replaced by None (the
    graph cannot run backward). It is subtracted from :func:`held_by_graph`'s figure to
    compare it with byte counts of tensors. Under torchstash, each tensor a strategy keeps
    (each payload tensor of a record) adds its own few hundred bytes of ``TensorImpl`` and
    ``StorageImpl`` on top, which no count of tensor bytes includes."""
    with torch.autograd.graph.saved_tensors_hooks(_keep_nothing, _never):
        return held_by_graph(forward)


# -- readings ---------------------------------------------------------------------------------


@dataclass
class Reading:
    """One model under one strategy: what the gauge saw and what the handle's tally says."""

    case: str
    strategy: str  # "stock" for PyTorch with nothing applied
    heap: int  # bytes the graph held, by the gauge
    overhead: int  # of which its nodes and records (graph_overhead, on the stock model)
    raw_bytes: int = 0  # the tally's count of what stock would hold (0 for stock)
    stored_bytes: int = 0  # the tally's count of what it holds
    host_bytes: int = 0  # of stored_bytes, in host memory for an accelerator's tensor
    held_bytes: int = 0  # the tally's count of what the allocator holds for stored_bytes

    @property
    def tensor_bytes(self) -> int:
        """The gauge's figure for the tensors the graph held: ``heap - overhead``."""
        return self.heap - self.overhead


@dataclass(frozen=True)
class Case:
    """A model and a step's forward: ``build()`` gives the model (seeded before it is called),
    ``forward(model)`` makes its inputs and returns the loss."""

    name: str
    build: Callable[[], nn.Module]
    forward: Callable[[nn.Module], Tensor]
    #: strategy options for this case (``dropit.mink``'s gamma...)
    options: dict[str, dict[str, Any]] | None = None


def read(
    case: Case, strategy: str | None = None, *, backend: str | None = None, **options: Any
) -> Reading:
    """The gauge and the tally on ``case`` under ``strategy`` (None: stock, nothing applied).

    One step runs first (kernels load, caches fill, gradients are allocated) and the graph's
    overhead is read on the stock model; then the strategy is applied, one step runs again,
    and the next forward is read. With ``backend``, each forward is ``torch.compile``'s with
    that backend (its graph is one autograd node: no overhead is read)."""
    from ..api import apply

    def compiled(model: nn.Module) -> nn.Module:
        if backend is None:
            return model
        return cast(nn.Module, torch.compile(model, backend=backend))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = case.build()
        run = compiled(model)
        case.forward(run).backward()
        overhead = 0 if backend else graph_overhead(lambda: case.forward(model))
        if strategy is None:
            heap = held_by_graph(lambda: case.forward(run))
            return Reading(case.name, "stock", heap, overhead)
        opts = dict((case.options or {}).get(strategy, {}), **options)
        with apply(model, strategy, **opts) as handle:
            run = compiled(model)
            case.forward(run).backward()
            handle.tally.reset()
            heap = held_by_graph(lambda: case.forward(run))
            tally = handle.tally
            host = sum(r.host_bytes for r in tally.rows.values())
            return Reading(
                case.name,
                strategy,
                heap,
                overhead,
                tally.raw_bytes,
                tally.stored_bytes,
                host,
                tally.held_bytes,
            )
    finally:
        torch.set_num_threads(threads)


def read_all(cases: Iterable[Case], strategies: Sequence[str]) -> list[Reading]:
    """Stock, then each strategy, on each case (strategies not installed are left out)."""
    from ..errors import ApplyError
    from ..registry import REGISTRY

    known = {s.name for s in REGISTRY.strategies()}
    out = []
    for case in cases:
        out.append(read(case))
        for s in strategies:
            if s not in known:
                continue
            try:
                out.append(read(case, s))
            except ApplyError:  # nothing for it in this model (memsave on a Linear chain)
                continue
    return out


def run_isolated(
    cases: Sequence[str], strategies: Sequence[str], scale: float = 1, timeout: float = 600
) -> list[Reading]:
    """:func:`read_all` in a fresh interpreter started with :data:`ISOLATED_ENV`
    (``MALLOC_ARENA_MAX=1`` must be set before a process's first allocation)."""
    env = {**os.environ, **ISOLATED_ENV}
    cmd = [sys.executable, "-m", "torchstash.testing.heap", "--json"]
    cmd += ["--cases", ",".join(cases), "--strategies", ",".join(strategies)]
    cmd += ["--scale", str(scale)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return [Reading(**r) for r in json.loads(done.stdout.strip().splitlines()[-1])]


# -- the models -------------------------------------------------------------------------------


class WithLoss(nn.Module):
    """``net`` and its loss in one module: the loss's saves (a cross-entropy's log-softmax)
    are then inside the model, where torchstash sees them, as a Hugging Face model's are."""

    def __init__(self, net: nn.Module, loss: Callable[[Tensor, Tensor], Tensor]) -> None:
        super().__init__()
        self.net = net
        self.loss = loss

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return self.loss(self.net(x), y)


def _cross_entropy(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _gpt(sdpa: bool, scale: float) -> Case:
    from .models import GPT

    vocab, ctx, batch = 128, 64, _batch(8, scale)

    def forward(model: nn.Module) -> Tensor:
        g = torch.Generator().manual_seed(1)
        idx = torch.randint(0, vocab, (batch, ctx + 1), generator=g)
        return model(idx[:, :-1], idx[:, 1:])

    def build() -> nn.Module:
        return WithLoss(GPT(vocab, ctx, 128, 2, 4, sdpa=sdpa), _cross_entropy)

    return Case("gpt-sdpa" if sdpa else "gpt-manual", build, forward)


class SmallCNN(nn.Module):
    """Conv, BatchNorm and in-place ReLU, a depthwise conv, max pooling, a linear head."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            nn.Conv2d(3, w, 3, 1, 1, bias=False),
            nn.BatchNorm2d(w),
            nn.ReLU(inplace=True),
            nn.Conv2d(w, w, 3, 1, 1, groups=w, bias=False),  # depthwise
            nn.BatchNorm2d(w),
            nn.ReLU(inplace=True),
            nn.Conv2d(w, 2 * w, 1, bias=False),  # pointwise
            nn.BatchNorm2d(2 * w),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * w, 2 * w, 3, 1, 1, bias=False),
            nn.BatchNorm2d(2 * w),
            nn.ReLU(inplace=True),
        )
        self.head = nn.Linear(2 * w, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x).mean((2, 3)))


def _cnn(scale: float) -> Case:
    batch = _batch(8, scale)

    def forward(model: nn.Module) -> Tensor:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch, 3, 32, 32, generator=g)
        return model(x, torch.randint(0, 10, (batch,), generator=g))

    return Case("cnn", lambda: WithLoss(SmallCNN(), F.cross_entropy), forward)


def _linear_bf16(scale: float) -> Case:
    """A bfloat16 chain of projections (DropIT's subject): ``dropit.mink`` at gamma 0.9."""
    batch = _batch(64, scale)

    def build() -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(3):
            layers += [nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)]
        return WithLoss(nn.Sequential(*layers).to(torch.bfloat16), _square_mean)

    def forward(model: nn.Module) -> Tensor:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch, 256, generator=g).to(torch.bfloat16)
        return model(x, x)

    return Case("linear-bf16", build, forward, {"dropit.mink": {"gamma": 0.9}})


def _square_mean(out: Tensor, target: Tensor) -> Tensor:
    return (out.float() - target.float()).pow(2).mean()


def _hf_gpt2(scale: float) -> Case | None:
    """Hugging Face's GPT-2 built from a config (no weights), its loss computed inside."""
    if importlib.util.find_spec("transformers") is None:  # the ``hf`` extra
        return None
    vocab, ctx, batch = 256, 64, _batch(8, scale)

    def build() -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=vocab,
            n_positions=ctx,
            n_embd=128,
            n_layer=2,
            n_head=4,
            use_cache=False,
            bos_token_id=vocab - 1,
            eos_token_id=vocab - 1,
        )
        return GPT2LMHeadModel(config)

    def forward(model: nn.Module) -> Tensor:
        g = torch.Generator().manual_seed(1)
        idx = torch.randint(0, vocab, (batch, ctx), generator=g)
        return model(input_ids=idx, labels=idx).loss

    return Case("hf-gpt2", build, forward)


def _batch(base: int, scale: float) -> int:
    return max(1, round(base * scale))


def cases(scale: float = 1) -> dict[str, Case]:
    """The gauge's models, by name (``hf-gpt2`` where transformers is installed), with
    ``scale`` times their batch (the tensors grow, the graph's nodes do not; below 1, small
    tensors, whose records and allocator granularity are a large share of what is held)."""
    found = [_gpt(True, scale), _gpt(False, scale), _cnn(scale), _linear_bf16(scale)]
    hf = _hf_gpt2(scale)
    if hf is not None:
        found.append(hf)
    return {c.name: c for c in found}


#: The strategies the table reads by default.
STRATEGIES = (
    "none",
    "quant.int8",
    "quant.int2",
    "quant.mesa",
    "dropit.mink",
    "memsave",
    "offload.cpu",
)


def table(readings: Sequence[Reading]) -> str:
    """Library against gauge, per case and strategy. ``heap`` is the gauge's figure for the
    tensors the graph held (its nodes' overhead taken off); ``raw/heap`` is the tally's raw
    bytes over stock's, ``stored/heap`` its stored bytes over the strategy's and ``held/heap``
    what it counts the allocator holds for them (records and granularity: the share the heap
    holds beyond the payload); ``lib`` is the library's ratio (stored / raw) and ``gauge`` the
    heap's (the strategy's over stock's)."""
    stock = {r.case: r.tensor_bytes for r in readings if r.strategy == "stock"}
    lines = [
        f"{'case':12} {'strategy':12} {'heap':>10} {'raw':>10} {'stored':>10} "
        f"{'raw/heap':>8} {'st/heap':>8} {'held/heap':>9} {'lib':>7} {'gauge':>7} {'lib/gauge':>9}"
    ]
    for r in readings:
        heap = r.tensor_bytes
        if r.strategy == "stock":
            lines.append(f"{r.case:12} {'stock':12} {heap:>10}")
            continue
        base = stock.get(r.case, 0)
        lib = r.stored_bytes / r.raw_bytes if r.raw_bytes else math.nan
        gauge = heap / base if base else math.nan
        lines.append(
            f"{r.case:12} {r.strategy:12} {heap:>10} {r.raw_bytes:>10} {r.stored_bytes:>10} "
            f"{r.raw_bytes / base if base else math.nan:8.4f} "
            f"{r.stored_bytes / heap if heap else math.nan:8.4f} "
            f"{r.held_bytes / heap if heap else math.nan:9.4f} "
            f"{lib:7.4f} {gauge:7.4f} {lib / gauge - 1 if gauge else math.nan:+9.2%}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m torchstash.testing.heap",
        description="torchstash's tally against glibc's heap, on small CPU models",
    )
    parser.add_argument("--cases", default="", help="comma-separated (default: all)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--scale", type=float, default=1, help="times the models' batch")
    parser.add_argument("--json", action="store_true", help="one line of JSON readings")
    args = parser.parse_args(argv)
    why = why_unavailable()
    if why:
        raise SystemExit(f"torchstash.testing.heap: {why}")
    known = cases(args.scale)
    names = [n for n in args.cases.split(",") if n] or list(known)
    chosen = [known[n] for n in names if n in known]
    readings = read_all(chosen, [s for s in args.strategies.split(",") if s])
    if args.json:
        print(json.dumps([asdict(r) for r in readings]))
    else:
        print(table(readings))


if __name__ == "__main__":
    main()
