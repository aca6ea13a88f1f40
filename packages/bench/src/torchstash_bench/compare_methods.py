"""The methods ``torchstash bench --compare`` sets side by side, each attached to a fresh model
the same way: stock, per-block checkpointing (and SAC), ``save_on_cpu``, ``torch.compile``
(with a memory budget, and without), each torchstash strategy, checkpointing with a strategy
on the blocks' inputs, and strategies compiled; and the pack-hook counter that counts what every one of them holds for
backward (see :mod:`.compare`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from torchstash.api import Handle, apply
from torchstash.policy import parse_spec
from torchstash.testing.models import BasicBlock, Block

from .common import (
    STOCK,
    lossless_of,
    merge_declined,
    strategy_names,
)

CHECKPOINT, SAC, SAVE_ON_CPU, COMPILE = "checkpoint", "sac", "save_on_cpu", "compile-budget"
#: ``torch.compile(model)`` as it comes (no budget)
COMPILED = "compiled"
#: a pass-through Python pack and unpack pair around the forward (named, never a default)
EMPTY_HOOKS = "empty-hooks"
BASELINES = (CHECKPOINT, SAC, SAVE_ON_CPU, COMPILE, COMPILED)
#: checkpointing with a strategy on the blocks' inputs, and strategies compiled
#: (``torch.compile`` of the applied model: their codes in the graph), run by default where
#: the strategy is installed (``checkpoint+<any strategy>``, ``compiled+<any>`` may be named)
COMBINATIONS = (f"{CHECKPOINT}+quant.int8", f"{COMPILED}+quant.int8")
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


#: class names of the units checkpointing wraps in models from elsewhere: timm's transformer
#: blocks, torchvision's and timm's ResNet blocks
BLOCK_NAMES = frozenset({"Block", "BasicBlock", "Bottleneck"})


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The units checkpointing wraps: transformer blocks and ResNet basic and bottleneck
    blocks (the zoo's, or by their class names); in another model, the children of its
    longest ``ModuleList``/``Sequential``."""
    blocks = [
        m
        for m in model.modules()
        if isinstance(m, Block | BasicBlock) or type(m).__name__ in BLOCK_NAMES
    ]
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


def _detached(t: Tensor) -> Tensor:
    return t.detach()  # held without its graph: an output held as it is would be a cycle


def _same(t: Tensor) -> Tensor:
    return t


class EmptyHooks(Attached):
    """A pass-through Python pack and unpack pair around the forward: what anything that sees
    each saved tensor from Python pays before it does a thing with it (the speed bench's floor
    under the engine's hooks). With a counter it holds what stock holds, counted as stock's."""

    def forward(self, x: Tensor, counter: HeldCounter | None = None) -> Tensor:
        if counter is not None:
            return super().forward(x, counter)
        with torch.autograd.graph.saved_tensors_hooks(_detached, _same):
            return self.call(x)


class Compiled(Attached):
    """``torch.compile(model)`` with the partitioner's activation memory budget set around
    this method's own calls (it is read when a graph is compiled, at the first step); None:
    the default. Set only there: methods are attached side by side, and a budget held while
    attached had compiled the others' graphs with it too (the compare's `compiled` and
    `compiled+quant.int8` rows at half their bytes)."""

    #: the compile's backend (the tests take a quicker one)
    backend = "inductor"

    def __init__(self, model: nn.Module, budget: float | None) -> None:
        super().__init__(model)
        import torch._dynamo

        self.budget = budget
        torch._dynamo.reset()
        self.compiled = torch.compile(model, backend=self.backend)

    def call(self, x: Tensor) -> Tensor:
        import torch._functorch.config as functorch_config

        if self.budget is None:
            return cast(Tensor, self.compiled(x))
        with functorch_config.patch(activation_memory_budget=self.budget):
            return cast(Tensor, self.compiled(x))

    def close(self) -> None:
        import torch._dynamo

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


class CompiledStash(Stashed):
    """A torchstash strategy, then ``torch.compile`` of the model: its codes run in the
    compiled graph where they trace (else eagerly, with one warning); its tally counts what
    the graph saves."""

    #: the compile's backend (the tests take a quicker one)
    backend = "inductor"

    def __init__(self, model: nn.Module, spec: str) -> None:
        super().__init__(model, spec)
        import torch._dynamo

        torch._dynamo.reset()
        self.compiled = torch.compile(model, backend=self.backend)

    def call(self, x: Tensor) -> Tensor:
        return cast(Tensor, self.compiled(x))

    def held(self, counter: HeldCounter) -> tuple[int, int]:
        held = super().held(counter)
        self.info["in graph"] = self.handle.graph is not None
        return held

    def close(self) -> None:
        import torch._dynamo

        super().close()
        torch._dynamo.reset()


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
        elif n == EMPTY_HOOKS:
            out.append(Method(n, "torch", True, EmptyHooks))
        elif n == COMPILE:
            out.append(Method(n, "torch", False, functools.partial(Compiled, budget=budget)))
        elif n == COMPILED:
            out.append(Method(n, "torch", False, functools.partial(Compiled, budget=None)))
        elif n.startswith(f"{COMPILED}+"):
            spec = n.partition("+")[2]
            lossless = lossless_of(spec.partition(":")[0])
            out.append(
                Method(n, "torchstash", lossless, functools.partial(CompiledStash, spec=spec))
            )
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
