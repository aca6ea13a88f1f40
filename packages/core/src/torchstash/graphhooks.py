"""A strategy inside ``torch.compile``'s graphs: saved-tensor hooks AOTAutograd traces into them.

Pack and unpack are ``torch.fx.GraphModule`` hooks (``saved_tensors_hooks`` with both hooks
graph modules), which AOTAutograd inlines into the compiled forward (pack at its end, on each
value it saves) and backward (unpack at its start). While they are traced they are told the
saved value's node (``_get_saved_tensor_hook_context``): there, once per saved value, the
strategy decides as the eager engine does, from the same description: the site named from
the graph (:mod:`.graphsite`), the policy's compressor for it, ``min_bytes``, the
compressor's reasons, then its encoder (the call a replayed eager save makes), traced; the
unpack decodes with the compressor's own ``decompress``. Nothing of it runs in Python at run
time. A site whose code does not trace (it reads a value on the host, say) is saved as stock
saves it, with one warning naming it.

A code's random rounding needs a seed that changes each step: traced, it is drawn from the
data (a few of the tensor's own values, mixed with the compressor's seed stream), so the graph
consumes none of torch's random numbers (a run is then comparable with one without).
"""

from __future__ import annotations

import operator
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._python_dispatch import TorchDispatchMode

from . import graphcount, seeds
from .compressor import Compressor, Encoder, encoder_of, graph_refusal
from .engine.scope import ModuleInfo
from .engine.tally import Tally
from .engine.totals import Totals
from .errors import CompileFallbackWarning
from .graphkeep import eager_recomputes, statistic, view_base
from .graphsite import read_permutation, relu_output, site_of, trainable_state
from .kernels import kernels_in_graph
from .layout import dense_order, dense_strides, strides_in_order, with_layout
from .packed import Allocation, Packed, allocation, raw_nbytes
from .signs import pack_sign, unpack_sign
from .site import Site

Resolver = Callable[[Site, frozenset[str]], "Compressor | None"]
Lookup = Callable[[str], "tuple[torch.nn.Module, ModuleInfo] | None"]

#: what an attention kernel saves besides q, k, v and its output
ATTENTION_REASON = (
    "an attention kernel's log-sum-exp, seeds and masks stay exact in a compiled graph (its "
    "backward reads them with q, k, v and the output)"
)
EMPTY_REASON = "it is empty"
NO_OP_REASON = "no op saves it in the graph (a graph input or a constant)"
DYNAMIC_REASON = (
    "its code's record has sizes other than the value's, which a graph traced with dynamic "
    "shapes cannot carry to its backward"
)
OP_SPECIFIC_REASON = "its code is one op's (a pool's positions), and a graph's value serves all"
STATISTIC_REASON = (
    "a reduction's result (a softmax's maximum or sum, a normalization's statistics) is "
    "small and kept exact, as the eager engine keeps it"
)
NOT_RECOMPUTED_REASON = (
    "the graph saves an output eager recomputes from its coded input (a LayerNorm's, a "
    "GELU's), which this code keeps near stock's only recomputed: kept exact"
)


def _needs_recompute(compressor: Compressor) -> bool:
    """Whether an output eager recomputes that the graph saves all the same
    (:func:`.graphkeep.eager_recomputes`) must be kept exact for ``compressor``: its value
    code keeps eager's accuracy only where the graph recomputes (``graph_refusal`` of its
    value codec, told no)."""
    return graph_refusal(getattr(compressor, "values", compressor), False) is not None


_STATE = threading.local()


def _current() -> GraphHooks | None:
    stack: list[GraphHooks] | None = getattr(_STATE, "stack", None)
    return stack[-1] if stack else None


def _context() -> dict[str, Any] | None:
    from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context

    found: dict[str, Any] | None = _get_saved_tensor_hook_context()
    return found


def _pack(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    hooks, context = _current(), _context()
    if hooks is None or context is None:
        # saved outside AOTAutograd's graphs (a backend without it, or code between two
        # graphs): as stock saves it, and said once (see GraphHooks.entered)
        if hooks is not None:
            hooks.outside += 1
        return (x.detach(),)
    return hooks.pack(x, context)


def _unpack(packed: tuple[torch.Tensor, ...]) -> torch.Tensor:
    hooks, context = _current(), _context()
    if hooks is None or context is None:
        return packed[0]
    return hooks.unpack(packed, context)


def _hook_module(fn: Callable[..., Any], name: str) -> torch.fx.GraphModule:
    """A graph module calling ``fn`` on its one input, built node by node: without
    ``symbolic_trace``, which patches ``nn.Module.__call__`` for every thread while it runs."""
    graph = torch.fx.Graph()
    node = graph.call_function(fn, (graph.placeholder(name),))
    node.meta["is_wrapped"] = True
    graph.output(node)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


#: made once, at import: a graph module's code is executed when it is made, and the frames
#: that made it then stay referenced until the garbage collector runs (apply's would keep a
#: removed model alive)
_TEMPLATES = (_hook_module(_pack, "x"), _hook_module(_unpack, "packed"))


def _new_hook(template: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Another object than ``template``, the same graph and code (dynamo guards a compiled
    graph on its hooks' identity: each applied strategy has its own)."""
    hook = object.__new__(type(template))
    hook.__dict__.update(template.__dict__)
    return hook


@dataclass(slots=True)
class Decision:
    """What one saved value of a graph got."""

    site: Site
    compressor: Compressor | None = None
    skeleton: Packed | None = None  # the record, its tensors replaced by their positions
    strides: tuple[int, ...] | None = None
    reason: str = ""
    #: a ReLU's output, its signs kept exact beside its code (:func:`_with_signs`)
    signs: bool = False
    #: a value of symbolic sizes: the order its dimensions lie in memory (``strides`` would
    #: be the forward's symbols), its sizes carried (:func:`shape_carrier`)
    order: tuple[int, ...] | None = None
    #: coded as its op reads it, through this ``permute`` (:func:`.graphsite.read_permutation`)
    permuted: tuple[int, ...] | None = None


#: a skeleton's shape that is the saved value's, read at unpack from the shape carrier
#: (:func:`shape_carrier`): a graph traced with dynamic shapes has symbolic sizes, and those
#: of the forward are not the backward's
CARRIED = torch.Size([-1])


def inverse_permutation(dims: tuple[int, ...]) -> tuple[int, ...]:
    inverse = [0] * len(dims)
    for i, d in enumerate(dims):
        inverse[d % len(dims)] = i
    return tuple(inverse)


def flatten(packed: Packed, leaves: list[torch.Tensor], carried: bool = False) -> Packed:
    """``packed``'s tensors appended to ``leaves``; the record with their positions instead
    (and with ``carried``, its shape as :data:`CARRIED`)."""
    tensors: dict[str, Any] = {}
    for key, value in packed.tensors.items():
        if isinstance(value, Packed):
            tensors[key] = flatten(value, leaves, carried)
        else:
            tensors[key] = len(leaves)
            leaves.append(value)
    shape = CARRIED if carried else packed.shape
    return Packed(packed.codec, shape, packed.dtype, packed.device, tensors, packed.meta)


def unflatten(
    skeleton: Packed, leaves: tuple[torch.Tensor, ...], shape: torch.Size | None = None
) -> Packed:
    tensors: dict[str, Any] = {}
    for key, value in skeleton.tensors.items():
        tensors[key] = (
            unflatten(value, leaves, shape) if isinstance(value, Packed) else leaves[value]
        )
    size = shape if shape is not None and skeleton.shape is CARRIED else skeleton.shape
    return Packed(skeleton.codec, size, skeleton.dtype, skeleton.device, tensors, skeleton.meta)


def symbolic_shape(x: torch.Tensor) -> bool:
    """Whether ``x``'s sizes are symbols (a graph traced with dynamic shapes)."""
    return any(isinstance(n, torch.SymInt) and not n.node.expr.is_number for n in x.shape)


def shape_carrier(x: torch.Tensor) -> torch.Tensor:
    """A tensor of ``x``'s sizes over one byte (all strides 0), saved beside a code of a value
    of symbolic sizes: the backward graph reads the sizes from it, as its own symbols."""
    return torch.empty_strided(x.shape, (0,) * x.dim(), dtype=torch.uint8, device=x.device)


def _sizes_are_the_values(packed: Packed, x: torch.Tensor) -> bool:
    """Whether every record in ``packed`` has ``x``'s shape and no symbolic setting: what a
    code of a value of symbolic sizes must keep to be carried (:func:`shape_carrier`)."""
    if tuple(packed.shape) != tuple(x.shape):
        return False
    if any(isinstance(v, torch.SymInt) for v in packed.meta.values()):
        return False
    return all(
        _sizes_are_the_values(v, x) for v in packed.tensors.values() if isinstance(v, Packed)
    )


class HostRead(RuntimeError):
    """A code read a tensor's value on the host while it was traced."""


class NoHostReads(TorchDispatchMode):
    """Refuses a read of a tensor's value on the host (``.item()``, ``bool()``, a Python
    branch on a tensor) while a code is traced: in a graph it has no value to read, and
    traced it would break the graph later, far from the code that did it; refused here, the
    site is kept as stock saves it and named in a warning."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            raise HostRead(
                "it reads a tensor's value on the host (.item(), bool() or a Python branch "
                "on a tensor), which a compiled graph cannot"
            )
        return func(*args, **(kwargs or {}))


RELU_CODEC = "graph.relu"


def _with_signs(packed: Packed, x: torch.Tensor) -> Packed:
    """A ReLU's output coded as a value, with where it is above zero kept exact (one bit
    each): in a graph the one saved output serves the ReLU's backward, which reads only that,
    and the next op's (a conv's weight gradient), which reads the values. A value code
    alone rounds small outputs to zero, and the ReLU's backward then drops their gradient
    (the zoo's ResNet under int8: cosine 0.982 with stock's instead of 0.9999)."""
    return Packed(RELU_CODEC, x.shape, x.dtype, x.device, {"values": packed, "signs": pack_sign(x)})


def _decode_with_signs(compressor: Compressor, record: Packed) -> torch.Tensor:
    """The values, zero exactly where the output was and above zero where it was."""
    values, signs = record.tensors["values"], record.tensors["signs"]
    assert isinstance(values, Packed) and isinstance(signs, Packed)
    decoded = compressor.decompress(values)
    above = unpack_sign(signs) > 0
    tiny = torch.finfo(decoded.dtype).tiny
    return torch.where(above, decoded.clamp_min(tiny), torch.zeros_like(decoded))


#: values of a tensor its traced seed reads (spread over it), and their odd weights' mixer
_SAMPLES = 61
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)


def data_seed(x: torch.Tensor, stream: int) -> torch.Tensor:
    """A 0-dim int64 seed computed in the graph from ``x``'s values (their bits) and ``stream``
    (the compressor's next seed): new each step as the data are, no generator consumed."""
    flat = x.detach().reshape(-1)
    # positions spread over the tensor, computed from its size in the graph: no guard on
    # the size (a graph traced with dynamic shapes serves every size)
    where = torch.arange(_SAMPLES, dtype=torch.int64, device=x.device) * flat.numel() // _SAMPLES
    bits = flat[where].float().view(torch.int32).to(torch.int64)
    weights = torch.arange(1, 2 * _SAMPLES + 1, 2, dtype=torch.int64, device=x.device)
    stream64 = stream - (1 << 64) if stream >= 1 << 63 else stream
    return (bits * weights * _MIX).sum() + stream64


def _held(sizes: list[Any], rule: Allocation) -> Any:
    """What the allocator holds for tensors of ``sizes`` bytes, each over a storage of its own
    (:class:`~torchstash.packed.Allocation`); a symbolic size counts its records and bytes, its
    rounding left out (rounding a symbol would guard on it)."""
    total: Any = 0
    for n in sizes:
        if isinstance(n, torch.SymInt) and not n.node.expr.is_number:
            total = total + n + rule.tensor + rule.storage
        else:
            total += rule.held(int(n))
    return total


_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def _attention_operand(node: torch.fx.Node, site: Site, x: torch.Tensor) -> bool:
    """Whether an attention kernel's saved ``x`` is ``q``, ``k``, ``v`` or its output (its
    first), which a code may round; its log-sum-exp (a cuDNN kernel's is 4-D too), seeds and
    masks stay exact."""
    if not (x.dim() == 4 and x.is_floating_point()):
        return False
    if site.role in ("input", "arg1", "arg2"):
        return True
    while node.op == "call_function" and node.target in _ALIASES and node.args:
        node = node.args[0]
    return (
        site.role == "output"
        and node.op == "call_function"
        and node.target is operator.getitem
        and node.args[1] == 0
    )


class GraphHooks:
    """One applied strategy's graph-module hooks and its decisions while they are traced."""

    def __init__(
        self, resolve: Resolver, min_bytes: int, lookup: Lookup, strategy: str, tally: Tally
    ) -> None:
        self.resolve = resolve
        self.min_bytes = min_bytes
        self.lookup = lookup
        self.strategy = strategy
        self.tally = tally
        #: the pair ``saved_tensors_hooks`` is entered with: dynamo guards a compiled graph on
        #: their identity, so a graph compiled without them (or for another strategy) is
        #: never reused with them, nor theirs without them
        self.hooks = (_new_hook(_TEMPLATES[0]), _new_hook(_TEMPLATES[1]))
        self._decided: dict[tuple[int, str], Decision] = {}
        #: what a forward with a given signature saves (counted at each such call)
        self._totals: dict[tuple[Any, ...], list[Totals]] = {}
        #: the counts of the latest graph traced with dynamic shapes, in its size symbols
        self._dynamic: list[Totals] | None = None
        self._scratch: Tally | None = None
        self._counted: set[tuple[int, str]] = set()
        self._warned: set[str] = set()
        #: decisions taken while tracing, for tests and ``describe``
        self.decisions: list[Decision] = []
        #: tensors saved during compiled calls outside AOTAutograd's graphs (kept as they are)
        self.outside = 0
        #: the partitioner's activation memory budget while the graphs are compiled (None:
        #: the process's): ``apply(..., compile_budget=)``
        self.memory_budget: float | None = None
        #: the ops whose outputs every compressor lets be recomputed from its codes
        #: (:func:`~.compressor.recomputed_ops`): the graph recomputes them as the eager engine
        #: does (:mod:`torchstash.graphkeep`)
        self.recomputes: frozenset[str] = frozenset()
        #: ``(op, reader)``: ``op``'s output saved as ``reader``'s input, not recomputed
        #: (:func:`~.compressor.declined_readers`)
        self.declined: frozenset[tuple[str, str]] = frozenset()

    # -- around a compiled call ----------------------------------------------------------------

    @contextmanager
    def entered(
        self,
        signature: tuple[Any, ...],
        arguments: Callable[[], dict[str, Any]] = dict,
    ) -> Iterator[None]:
        """The hooks on (and this object current) for one call of the compiled model; what the
        call's graphs save is counted in the tally once it returns: as traced for this
        ``signature``, or, where a graph traced with dynamic shapes served it, that graph's
        counts at this call's sizes (``arguments`` gives the compiled frame's, :mod:`.graphcount`)."""
        stack = getattr(_STATE, "stack", None)
        if stack is None:
            stack = _STATE.stack = []
        stack.append(self)
        scratch = self._scratch = Tally()
        outside = self.outside
        try:
            with torch.autograd.graph.saved_tensors_hooks(*self.hooks):
                yield
        finally:
            stack.pop()
            self._scratch = None
            self._decided.clear()
            self._counted.clear()
        if self.outside > outside:
            self._warn_outside(self.outside - outside)
        if scratch.rows:  # traced in this call: what the signature's graphs save
            traced = graphcount.totals_of(scratch)
            if graphcount.symbolic(traced):
                self._dynamic = traced
            self._totals[signature] = graphcount.at(traced, arguments())
        elif signature not in self._totals and self._dynamic is not None:
            # a new shape no graph was traced for: the dynamic one served it
            found = arguments()
            if not graphcount.resolved(self._dynamic, found):
                self._warn_sizes()
            self._totals[signature] = graphcount.at(self._dynamic, found)
        totals = self._totals.get(signature)
        if totals is not None and torch.is_grad_enabled():
            self.tally.add_forward(totals)

    # -- traced --------------------------------------------------------------------------------

    def pack(self, x: torch.Tensor, context: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        node = context["_node"]
        if trainable_state(node, context["_fw_graph"]):
            return (x.detach(),)  # as eager keeps it: as is, outside the count
        key = (id(context["_fw_graph"]), node.name)
        site = site_of(node, self.lookup)
        decision = Decision(site)
        saved = x
        dims = read_permutation(node)
        if dims is not None:  # coded as its op reads it, as eagerly
            x = x.permute(dims)
            decision.permuted = dims
        compressor, decision.reason = self._choose(x, site, node)
        out: tuple[torch.Tensor, ...] = (saved.detach(),)
        if compressor is not None:
            stream = compressor_stream(compressor)
            try:
                with NoHostReads():
                    encode = value_encoder_of(compressor, x, site)
                    packed = None
                    if encode is not None:
                        with seeds.traced(data_seed(x, stream)), kernels_in_graph():
                            packed = encode(x)
            except Exception as e:
                decision.reason = f"its code does not trace ({type(e).__name__}: {e})"
                self._warn(site, decision.reason)
            else:
                if encode is None:
                    decision.reason = OP_SPECIFIC_REASON
                elif isinstance(packed, Packed):
                    if relu_output(node):
                        packed = _with_signs(packed, x)
                        decision.signs = True
                    carried = symbolic_shape(x)
                    if carried and not _sizes_are_the_values(packed, x):
                        decision.reason = DYNAMIC_REASON
                    else:
                        leaves: list[torch.Tensor] = []
                        decision.skeleton = flatten(packed, leaves, carried)
                        decision.compressor = compressor
                        if carried:
                            decision.order = dense_order(x)
                            leaves.append(shape_carrier(x))
                        else:
                            decision.strides = dense_strides(x)
                        out = tuple(leaves)
                else:
                    decision.reason = f"{compressor.name} declined it"
        self._decided[key] = decision
        self._count(key, saved, decision, out)
        return out

    def unpack(self, packed: tuple[torch.Tensor, ...], context: dict[str, Any]) -> torch.Tensor:
        decision = self._decided.get((id(context["_fw_graph"]), context["_node"].name))
        if decision is None or decision.skeleton is None or decision.compressor is None:
            return packed[0]
        carrier = packed[-1] if decision.order is not None else None
        shape = carrier.shape if carrier is not None else None
        record = unflatten(decision.skeleton, packed, shape)
        with kernels_in_graph():
            if decision.signs:
                value = _decode_with_signs(decision.compressor, record)
            else:
                value = decision.compressor.decompress(record)
        if carrier is not None and decision.order is not None:
            value = with_layout(value, strides_in_order(carrier.shape, decision.order))
        else:
            value = with_layout(value, decision.strides)
        if decision.permuted is not None:
            value = value.permute(inverse_permutation(decision.permuted))
        return value

    def _choose(
        self, x: torch.Tensor, site: Site, node: torch.fx.Node
    ) -> tuple[Compressor | None, str]:
        # decided without a guard where the size is a symbol: a value of symbolic size is
        # coded (at its smaller sizes too) rather than the graph recompiled at the threshold
        if statically_known_true(raw_nbytes(x) < self.min_bytes):
            return None, f"smaller than min_bytes={self.min_bytes}"
        if statically_known_true(x.numel() == 0):  # (a symbolic size is 2 or more)
            return None, EMPTY_REASON
        if not site.op:
            return None, NO_OP_REASON
        if statistic(view_base(node)):
            return None, STATISTIC_REASON
        attention = site.op == "scaled_dot_product_attention"
        if attention and not _attention_operand(node, site, x):
            return None, ATTENTION_REASON
        found = self.lookup(site.module)
        types = found[1].type_names if found is not None else frozenset({site.module_type})
        compressor = self.resolve(site, types)
        if compressor is None:
            return None, ""
        reasons = compressor.unsupported(x, site)
        if reasons:
            return None, "; ".join(reasons)
        if eager_recomputes(node) and _needs_recompute(compressor):
            return None, NOT_RECOMPUTED_REASON
        return compressor, ""

    def _count(
        self, key: tuple[int, str], x: torch.Tensor, decision: Decision, out: tuple[Any, ...]
    ) -> None:
        """Count a saved value once per call (its hook is traced twice)."""
        scratch = self._scratch
        if scratch is None or key in self._counted:
            return
        self._counted.add(key)
        self.decisions.append(decision)
        site = decision.site
        row = scratch.row(site)
        row.saved += 1
        row.ops[site.op or "?"] += 1
        raw = raw_nbytes(x)  # a SymInt in a graph traced with dynamic shapes: kept one
        kept = [raw_nbytes(t) for t in out] if decision.compressor else [raw]
        if decision.order is not None:  # the shape carrier holds one byte, not its sizes'
            kept[-1] = 1
        row.raw_bytes += raw
        row.stored_bytes += sum(kept)
        row.held_bytes += _held(kept, allocation(x.device))
        if decision.compressor is not None:
            row.compressed += 1
        elif decision.reason:
            row.declined[decision.reason] += 1

    def _warn_outside(self, count: int) -> None:
        if "<outside>" in self._warned:
            return
        self._warned.add("<outside>")
        warnings.warn(
            f"torchstash: {self.strategy!r} codes what AOTAutograd's graphs save, and this "
            f"compiled call saved {count} tensor(s) outside them, as stock PyTorch saves them: "
            "its backend has no AOTAutograd (backend='eager'), or its graph breaks. Compile "
            "with a backend that has it (inductor, the default, or aot_eager), with "
            "fullgraph=True to find a break.",
            CompileFallbackWarning,
            stacklevel=3,
        )

    def _warn_sizes(self) -> None:
        if "<sizes>" in self._warned:
            return
        self._warned.add("<sizes>")
        warnings.warn(
            f"torchstash: {self.strategy!r} counts what a graph traced with dynamic shapes "
            "saves at each call's sizes, read from the model's arguments; some of this "
            "model's graphs have sizes of their own (a graph after a graph break inside the "
            "model), which the tally counts at the sizes they were traced at. The codes are "
            "unaffected; for exact counts, compile without graph breaks (fullgraph=True finds "
            "them).",
            CompileFallbackWarning,
            stacklevel=3,
        )

    def _warn(self, site: Site, reason: str) -> None:
        where = site.describe()
        if where in self._warned:
            return
        self._warned.add(where)
        warnings.warn(
            f"torchstash: {self.strategy!r} keeps {where} as stock PyTorch saves it in the "
            f"compiled graph: {reason}",
            CompileFallbackWarning,
            stacklevel=2,
        )


def value_encoder_of(compressor: Compressor, x: torch.Tensor, site: Site) -> Encoder | None:
    """The compressor's encoder of a code whose restore is the value (``value_encoder``,
    for one whose codes are op-specific at some sites), else its encoder: a compiled graph
    saves a value once for every op that reads it in backward. None: nothing fits."""
    told = getattr(compressor, "value_encoder", None)
    if told is not None:
        found: Encoder | None = told(x, site)
        return found
    return encoder_of(compressor, x, site)


def compressor_stream(compressor: Compressor) -> int:
    """The next seed of the compressor's own stream, or of its value codec's (0 for one
    without): mixed into a traced seed so two sites' codes of equal values draw differently,
    and two runs of other ``seed=`` options differently."""
    for part in (compressor, getattr(compressor, "values", None)):  # an op-aware code's values
        stream = getattr(part, "seeds", None)
        if isinstance(stream, seeds.SeedStream):
            return stream.next()
    return 0


__all__ = ["GraphHooks", "data_seed", "flatten", "unflatten"]
