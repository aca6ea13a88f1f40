"""The user-facing verbs: ``apply``/``remove`` for a model, ``stash`` for any code region."""

from __future__ import annotations

import contextvars
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from . import tags

if TYPE_CHECKING:
    from .budget import BudgetPlan
from .compiling import EagerUnderCompile, GraphUnderCompile, compiling, warn_compiled
from .compressor import declined_readers, graph_refusal, recomputed_ops
from .engine import DEFAULT_MIN_BYTES, Engine, ModuleInfo, Tally
from .engine.replay import Replayer
from .errors import ApplyError, NothingToRewriteWarning
from .graphhooks import GraphHooks
from .graphkeep import RECOMPUTED_OPS
from .modulecalls import CallEntry, takes_entry
from .packed import storage_base
from .plan import Plan, Swapped
from .policy import Policy, Rule, as_policy
from .registry import Registry, resolved
from .site import Site

PolicyLike = Policy | str | Path | Sequence[Mapping[str, Any] | Rule]

_HANDLES: weakref.WeakKeyDictionary[nn.Module, Handle] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Rewrite:
    """One module rewritten: replaced in its parent, or changed in place (``undo`` set)."""

    parent: nn.Module | None
    name: str
    original: nn.Module
    replacement: nn.Module
    qualname: str
    undo: Callable[[], None] | None = None

    def revert(self) -> None:
        if self.undo is not None:
            self.undo()
        elif self.parent is not None:
            setattr(self.parent, self.name, self.original)


class Handle:
    """What :func:`apply` did to a model; :meth:`remove` undoes it exactly."""

    def __init__(self, model: nn.Module, plan: Plan, engine: Engine) -> None:
        self._model = weakref.ref(model)
        self.plan = plan
        self.engine = engine
        self.hooks: list[RemovableHandle | CallEntry | EagerUnderCompile | GraphUnderCompile] = []
        self.rewrites: list[Rewrite] = []
        self.removed = False
        self.budget: BudgetPlan | None = None  # what apply(budget_mb=...) chose
        #: the strategy's hooks inside a compiled graph, where its codes trace
        #: (:mod:`torchstash.graphhooks`); None where the model runs eagerly under compile
        self.graph: GraphHooks | None = None

    @property
    def policy(self) -> Policy:
        return self.plan.policy

    @property
    def tally(self) -> Tally:
        """Saved-tensor accounting since the last ``tally.reset()``."""
        return self.engine.tally

    def remove(self) -> None:
        """Take the hooks off and put every rewritten module back."""
        if self.removed:
            return
        for h in self.hooks:
            h.remove()
        for rw in reversed(self.rewrites):
            rw.revert()
        self.hooks.clear()
        self.rewrites.clear()
        self.removed = True
        model = self._model()
        if model is not None and _HANDLES.get(model) is self:
            del _HANDLES[model]

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self.removed else f"{len(self.rewrites)} modules rewritten"
        return f"<torchstash.Handle {self.policy.name!r}, {state}>"


def _as_plan(
    strategy: str | None,
    policy: PolicyLike | None,
    options: dict[str, Any],
    registry: Registry | None = None,
) -> Plan:
    if strategy is not None and policy is not None:
        raise ApplyError("give a strategy name or a policy, not both")
    if policy is not None:
        if options:
            raise ApplyError(
                f"options {sorted(options)} go inside the policy's rules, not beside a policy"
            )
        return Plan(as_policy(policy, registry=registry), registry)
    if strategy is None:
        raise ApplyError("give a strategy name (see torchstash.strategies()) or a policy")
    if not isinstance(strategy, str):
        raise ApplyError(f"strategy must be a name such as 'quant.int8', got {strategy!r}")
    return Plan(Policy.single(strategy, **options), registry)


def apply(
    model: nn.Module,
    strategy: str | None = None,
    *,
    policy: PolicyLike | None = None,
    min_bytes: int = DEFAULT_MIN_BYTES,
    budget_mb: float | None = None,
    example: Any = None,
    candidates: Sequence[str] | None = None,
    registry: Registry | None = None,
    compile_budget: float | None = None,
    **options: Any,
) -> Handle:
    """Make ``model`` save less for backward, in place (no copy; ``state_dict`` keys unchanged).

    ``strategy`` names one strategy for every saved tensor (options go as keywords);
    ``policy`` gives per-layer rules (a :class:`Policy`, a file path, or a list of rule dicts).
    ``budget_mb`` instead picks per-module strategies among ``candidates`` that keep what
    autograd saves on ``example`` (a function running one step's forward and returning the
    loss) under that many megabytes, with the least measured gradient error; the choice is in
    ``handle.budget`` (see :mod:`torchstash.budget`). ``registry``: where strategies are looked
    up (default: the process's, with every installed plug-in). ``compile_budget``: under
    ``torch.compile``, the fraction of stock's saved bytes the partitioner keeps while this
    model's graphs are compiled (``torch._functorch.config.activation_memory_budget``: inductor
    recomputes the cheapest values in backward, the strategy codes what it still saves); for
    a strategy whose codes run in the graph.
    Returns a :class:`Handle`; ``handle.remove()`` or :func:`remove` restores the model.
    """
    if not isinstance(model, nn.Module):
        raise ApplyError(f"apply() needs an nn.Module, got {type(model).__name__}")
    if budget_mb is not None:
        if strategy is not None or policy is not None or options:
            raise ApplyError(
                "budget_mb chooses the strategies itself: give it without a strategy, a "
                "policy or options (narrow the choice with candidates=[...])"
            )
        from .budget import plan_budget

        _refuse_applied(model)
        chosen = plan_budget(
            model,
            budget_mb,
            example,
            apply=apply,
            candidates=candidates,
            min_bytes=min_bytes,
            registry=registry,
        )
        handle = apply(
            model,
            policy=chosen.rules,
            min_bytes=min_bytes,
            registry=registry,
            compile_budget=compile_budget,
        )
        handle.budget = chosen
        return handle
    if example is not None or candidates is not None:
        raise ApplyError("example= and candidates= go with budget_mb=")
    _refuse_applied(model)
    if compile_budget is not None and not (
        isinstance(compile_budget, (int, float)) and 0 < compile_budget <= 1
    ):
        raise ApplyError(
            f"compile_budget must be a fraction in (0, 1] of stock's saved bytes, got "
            f"{compile_budget!r}"
        )
    plan = _as_plan(strategy, policy, options, registry)
    plan.check_types({n for m in model.modules() for n in tags.type_names(m)})

    # The model's modules, once rewritten: read at the first forward. Held weakly: the
    # engine keeps this function, and an engine in a reference cycle (its replayer) must
    # not keep a removed model's weights alive until the garbage collector runs.
    root = weakref.ref(model)
    modules: list[weakref.ref[nn.Module]] = []
    #: the parameters as the last recorded forward found them (see ``trainable``)
    params: list[weakref.ref[nn.Parameter]] = []

    def params_and_buffers() -> set[int]:
        """Read once a recorded forward: the modules' own dicts, not ``model.parameters()``,
        whose generators cost a millisecond a step on a model of a hundred modules."""
        if not modules:
            found = root()
            modules.extend(weakref.ref(m) for m in (found.modules() if found else ()))
        ptrs = set()
        params.clear()
        for ref in modules:
            m = ref()
            if m is None:
                continue
            for p in m._parameters.values():
                if p is not None:
                    ptrs.add(storage_base(p))
                    params.append(weakref.ref(p))
            for b in m._buffers.values():
                if b is not None:
                    ptrs.add(storage_base(b))
        return ptrs

    def trainable() -> tuple[bool | None, ...]:
        """Which of the parameters the last recorded forward found train (what a frozen
        layer saves differs; None: gone): read before each forward that would run with no
        hook (:mod:`torchstash.engine.hookless`). A parameter set on a module since then
        is not among them: the check that one forward in 64 makes sees what it changes."""
        if not modules:
            params_and_buffers()
        return tuple(None if (p := ref()) is None else p.requires_grad for ref in params)

    engine = Engine(
        plan.compressor,
        min_bytes=min_bytes,
        skip_ptrs=params_and_buffers,
        names=plan,
        state_key=trainable,
    )
    handle = Handle(model, plan, engine)
    try:
        if plan.has_rewriters:
            _rewrite(model, plan, handle)
            if not handle.rewrites and not plan.has_compressors:
                warnings.warn(
                    f"torchstash: {plan.policy.name!r} found no module to rewrite in "
                    f"{type(model).__name__}; nothing changes (the model saves what it did)",
                    NothingToRewriteWarning,
                    stacklevel=2,
                )
        _install_hooks(model, engine, handle, compile_budget)
    except BaseException:
        handle.remove()
        raise
    _HANDLES[model] = handle
    return handle


def _refuse_applied(model: nn.Module) -> None:
    """One handle per module tree: applying to a model, a submodule of an applied model or a
    model holding an applied one would stack two engines on the same saves."""
    for name, sub in model.named_modules():
        if sub in _HANDLES:
            where = f"submodule {name!r}" if name else "this model"
            raise ApplyError(
                f"torchstash is already applied to {where}; call torchstash.remove() on it "
                f"first, or express both settings as one policy"
            )
    for applied in list(_HANDLES.keys()):
        for name, sub in applied.named_modules():
            if sub is model and name:
                raise ApplyError(
                    f"torchstash is already applied to a {type(applied).__name__} that holds "
                    f"this {type(model).__name__} as {name!r}; call torchstash.remove() on it "
                    "first, or give this submodule its own rule in one policy "
                    f"(module = {name!r})"
                )


def remove(model: nn.Module) -> None:
    """Undo :func:`apply` on ``model``."""
    handle = _HANDLES.get(model)
    if handle is None:
        raise ApplyError(f"torchstash is not applied to this {type(model).__name__}")
    handle.remove()


def handle_of(model: nn.Module) -> Handle | None:
    """The active handle of ``model``, if :func:`apply` was called on it."""
    return _HANDLES.get(model)


def _infos(model: nn.Module) -> Iterator[tuple[str, nn.Module, ModuleInfo]]:
    counts: dict[str, int] = {}
    for name, m in model.named_modules():
        tag = tags.tag_of(m)
        index = counts.get(tag, 0)
        counts[tag] = index + 1
        yield name, m, ModuleInfo(name, tag, type(m).__name__, index, tags.type_names(m))


def _site_of(info: ModuleInfo) -> Site:
    return info.site()


def _rewrite(model: nn.Module, plan: Plan, handle: Handle) -> None:
    """Offer every module (the model itself included) to the rewriters that select it.

    A replacement is set into the parent (the model itself can only be changed in place); a
    module changed in place is visited once even where it is registered under two parents.
    """
    replaced: list[str] = []
    seen: set[int] = set()
    for name, module, info in list(_infos(model)):
        if any(name.startswith(r + ".") for r in replaced) or id(module) in seen:
            continue
        seen.add(id(module))
        for rewriter in plan.rewriters(_site_of(info), info.type_names):
            new = rewriter.rewrite(module)
            if isinstance(new, Swapped):
                handle.rewrites.append(Rewrite(None, name, module, module, name, new.undo))
                continue
            if new is None or new is module:
                continue
            if not name:
                raise ApplyError(
                    f"{rewriter.name} returned a new module for the model itself; a "
                    "rewriter may change the model only in place (torchstash.plan.Swapped)"
                )
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, attr, new)
            handle.rewrites.append(Rewrite(parent, attr, module, new, name))
            replaced.append(name)
            module = new


def _install_hooks(
    model: nn.Module, engine: Engine, handle: Handle, compile_budget: float | None
) -> None:
    compresses = handle.plan.has_compressors
    infos = list(_infos(model))
    refusals = _graph_refusals(handle.plan, compile_budget is not None)
    graphed = compresses and not refusals
    if compile_budget is not None and not graphed:
        why = "; ".join(refusals) if refusals else "it compresses nothing"
        raise ApplyError(
            f"compile_budget= sets what the compiled graph saves before "
            f"{handle.plan.policy.name!r} codes it, and {handle.plan.policy.name!r} does not "
            f"run in the compiled graph ({why}; see docs/compile.md): leave compile_budget "
            "out, or set torch._functorch.config.activation_memory_budget yourself"
        )
    if graphed:
        graph = GraphHooks(
            engine.resolve, engine.min_bytes, _lookup(infos), handle.policy.name, engine.tally
        )
        graph.memory_budget = None if compile_budget is None else float(compile_budget)
        compressors = [b.compressor for b in handle.plan.built.values() if b.compressor is not None]
        graph.recomputes = frozenset.intersection(
            RECOMPUTED_OPS, *(recomputed_ops(c, RECOMPUTED_OPS) for c in compressors)
        )
        graph.declined = frozenset().union(
            *(declined_readers(c, RECOMPUTED_OPS) for c in compressors)
        )
        handle.graph = graph
        handle.hooks.append(GraphUnderCompile(model, graph, engine))
    elif compresses:
        handle.hooks.append(EagerUnderCompile(model, handle.policy.name, refusals))

    def traced() -> None:
        # traced: in the graph (its hooks), past the eager fallback, or a rewrite-only plan
        if compresses and not graphed:
            warn_compiled(model, "traced")

    for _, module, info in infos:
        if takes_entry(module):  # the usual case: torch's fast call path kept (.modulecalls)
            handle.hooks.append(CallEntry(module, engine, info, traced))
            continue

        def pre(m: nn.Module, args: Any, kwargs: Any, info: ModuleInfo = info) -> None:
            if compiling():
                traced()
                return
            engine.enter_module(info, m, args, kwargs)

        def post(m: nn.Module, args: Any, out: Any) -> None:
            if compiling():
                return
            engine.exit_module(m)

        handle.hooks.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handle.hooks.append(module.register_forward_hook(post, always_call=True))


def _graph_refusals(plan: Plan, budgeted: bool) -> list[str]:
    """Why ``plan``'s compressors do not run in a compiled graph, one line each (none where
    every one does): ``budgeted``, the model is applied with ``compile_budget``."""
    found: list[str] = []
    for b in plan.built.values():
        if b.compressor is not None:
            why = graph_refusal(b.compressor, budgeted)
            if why is not None and why not in found:
                found.append(why)
    return found


def _lookup(
    infos: list[tuple[str, nn.Module, ModuleInfo]],
) -> Callable[[str], tuple[nn.Module, ModuleInfo] | None]:
    """A model's module by its qualified name, with what the engine knows of it (held
    weakly: the compiled path's hooks outlive no model)."""
    found = {name: (weakref.ref(m), info) for name, m, info in infos}

    def lookup(name: str) -> tuple[nn.Module, ModuleInfo] | None:
        entry = found.get(name)
        if entry is None:
            return None
        module = entry[0]()
        return None if module is None else (module, entry[1])

    return lookup


#: The stash blocks open in the running context. Torch's saved-tensor hooks and the global
#: module hooks a block installs are seen by every thread (and every asyncio task on this
#: thread); this marks which code is inside the block, so another thread's or task's model is
#: left exactly as stock PyTorch runs it.
_OPEN_STASHES: contextvars.ContextVar[tuple[stash, ...]] = contextvars.ContextVar(
    "torchstash_open_stashes", default=()
)


#: per thread, the plan and replayer of each strategy's ``stash`` blocks (see :func:`_shared`)
_STASH_SHARED = threading.local()


@dataclass(slots=True, eq=False)
class _Shared:
    """What the ``stash`` blocks opened at one line share: their plan's compressors (whose
    state, a seed stream or ``quant.auto``'s measurements, goes on from step to step) and the
    record of decisions they replay."""

    plan: Plan
    replayer: Replayer


def _shared(
    strategy: str | None,
    policy: PolicyLike | None,
    options: dict[str, Any],
    min_bytes: int,
    module: nn.Module | None,
    where: tuple[str, int],
    registry: Registry,
) -> _Shared | None:
    """What every ``stash`` block opened at the same line of code (``where``) with this
    strategy, options and module shares on this thread: a training loop opens a new block each
    step, whose own compressors would start afresh (``quant.auto`` measuring forever) and whose
    own engine would record every time; two regions of code (a GAN's two steps) keep theirs
    apart. None (the block builds its own) for a policy object, which has no stable key, or
    options that cannot be one."""
    if policy is not None or strategy is None:
        return None
    try:
        key = (
            where,
            strategy,
            tuple(sorted(options.items())),
            min_bytes,
            id(module),
            id(registry),
            registry.generation,  # a strategy registered anew: built anew
        )
        hash(key)
    except TypeError:
        return None
    table: dict[Any, _Shared] | None = getattr(_STASH_SHARED, "table", None)
    if table is None:
        table = _STASH_SHARED.table = {}
    found = table.get(key)
    if found is None:
        plan = _as_plan(strategy, None, options, registry)  # a bad name raises, is not kept
        found = table[key] = _Shared(plan, Replayer(Tally(), set, _no_code))
    return found


def _caller() -> tuple[str, int]:
    """The file and line that opened the ``stash`` block (``stash.__init__``'s caller)."""
    frame = sys._getframe(2)
    return frame.f_code.co_filename, frame.f_lineno


def _no_code(t: Any, move: Any) -> None:
    return None  # bound to a block's engine before any forward replays


class stash:
    """Compress what autograd saves inside a ``with`` block: any code, functional ops included.

    The block covers the thread (and the ``contextvars`` context, so the asyncio task) that
    entered it: another thread's or task's training runs as stock PyTorch would, even while
    the block is open.

    >>> with torchstash.stash("quant.int8"):
    ...     loss = step(batch)
    >>> loss.backward()
    """

    def __init__(
        self,
        strategy: str | None = None,
        *,
        policy: PolicyLike | None = None,
        min_bytes: int = DEFAULT_MIN_BYTES,
        module: nn.Module | None = None,
        registry: Registry | None = None,
        **options: Any,
    ) -> None:
        """``module``: the block runs inside that module's forward (a layer that compresses
        its own saves): its Parameters and buffers are left as they are, and its saves are
        counted and named as its. ``registry``: where strategies are looked up (default: the
        process's)."""
        registry = resolved(registry)
        shared = _shared(strategy, policy, options, min_bytes, module, _caller(), registry)
        self.plan = (
            shared.plan if shared is not None else _as_plan(strategy, policy, options, registry)
        )
        self.module = module
        if self.plan.has_rewriters:
            names = [b.name for b in self.plan.built.values() if b.rewriters]
            raise ApplyError(
                f"{', '.join(names)} rewrites modules, which a code region cannot do; "
                f"use torchstash.apply(model, ...) instead"
            )
        self.engine = Engine(
            self.plan.compressor,
            min_bytes=min_bytes,
            in_scope=self._in_scope,
            replayer=shared.replayer if shared is not None else None,
            names=self.plan,
        )
        self._exit: Any = None
        self._token: contextvars.Token[tuple[stash, ...]] | None = None
        self._hooks: list[RemovableHandle] = []
        self._infos: weakref.WeakKeyDictionary[nn.Module, ModuleInfo] = weakref.WeakKeyDictionary()

    @property
    def tally(self) -> Tally:
        return self.engine.tally

    @property
    def active(self) -> bool:
        """Whether the block is open (a block is not re-entered while it is)."""
        return self._exit is not None

    def __enter__(self) -> stash:
        if self._exit is not None:
            raise ApplyError("this stash block is already active; create a new one")
        self._token = _OPEN_STASHES.set((*_OPEN_STASHES.get(), self))
        self._exit = self.engine.activated()
        self._exit.__enter__()
        # Modules run inside the block have no qualified name here; their type still lets
        # policies select by ``type`` and groups the accounting as ``<ClassName>``.
        self._hooks = [
            nn.modules.module.register_module_forward_pre_hook(self._enter),
            nn.modules.module.register_module_forward_hook(self._leave, always_call=True),
        ]
        if self.module is not None:  # already in its forward: its pre-hooks have run
            self._enter(self.module, ())
        return self

    def _in_scope(self) -> bool:
        return self in _OPEN_STASHES.get()

    def _enter(self, module: nn.Module, args: Any) -> None:
        if not self._in_scope():
            return  # another thread's or task's module: the block does not cover it
        info = self._infos.get(module)
        if info is None:
            name = type(module).__name__
            info = ModuleInfo(f"<{name}>", tags.tag_of(module), name, -1, tags.type_names(module))
            self._infos[module] = info
        self.engine.skip_module_state(module)
        self.engine.enter_module(info, module)

    def _leave(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._in_scope():
            self.engine.exit_module(module)

    def __exit__(self, *exc: object) -> None:
        if self.module is not None and self._exit is not None:
            self._leave(self.module, (), None)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        ctx, self._exit = self._exit, None
        token, self._token = self._token, None
        try:
            ctx.__exit__(*exc)
        finally:
            if token is not None:
                try:
                    _OPEN_STASHES.reset(token)
                except ValueError:  # left in another context than it was entered in
                    _OPEN_STASHES.set(tuple(s for s in _OPEN_STASHES.get() if s is not self))


def strategies(registry: Registry | None = None) -> list[dict[str, Any]]:
    """Installed strategies: name, distribution, version, lossless, summary, options."""
    return [s.describe() for s in resolved(registry).strategies()]
