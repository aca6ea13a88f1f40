"""What ``torch.compile`` sees of a model torchstash was applied to.

Where every compressor of the strategy has a traced form (:func:`~.compressor.graph_refusal`:
``quant.int8``, ``quant.int4`` and their presets), the model's compiled
call runs with the strategy's GraphModule saved-tensor hooks on (:class:`GraphUnderCompile`,
:mod:`.graphhooks`): the codes run inside the compiled forward and backward. Any other
compressing strategy runs *eagerly* under ``torch.compile``, with the memory savings intact and
one warning quoting its compressors' reasons (under ``fullgraph=True``, dynamo's error quotes
them). Rewrite-only strategies (``memsave``) change the model's modules, which compile as they
are: there the hooks step aside while dynamo traces.

``torch.compiler.disable`` imports all of dynamo (over a second), so the disabled functions
are made when a model is first applied to, not when torchstash is imported: ``torchstash list``
and a script that never applies anything do not pay for it.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .compressor import NOT_TRACEABLE
from .errors import CompileFallbackWarning
from .replicas import rebind_replicas, unbind_replicas

_WARNED: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
_STRATEGY: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
#: why an applied model's strategy runs eagerly under torch.compile (its compressors' reasons)
_WHY: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()

_REASON = "torchstash compresses saved tensors in Python hooks, which a compiled graph cannot run"


def compiling() -> bool:
    """Whether dynamo is tracing the calling code (constant-folded while it traces)."""
    return bool(torch.compiler.is_compiling())


def _call_eagerly(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return nn.Module._call_impl(module, *args, **kwargs)


#: the two functions dynamo must not trace, disabled once (see the module docstring)
_DISABLED: dict[str, Callable[..., Any]] = {}


def _prepare(strategy: str | None = None, why: str = "") -> None:
    """Make the disabled functions (imports dynamo): at apply time, before any tracing."""
    if not _DISABLED:
        _DISABLED["run"] = torch.compiler.disable(_call_eagerly, reason=_REASON)
    for what in ("eager", "traced"):
        key = f"warn:{strategy}:{what}:{why}"
        if strategy is not None and key not in _DISABLED:
            _DISABLED[key] = torch.compiler.disable(
                _warn, reason=fullgraph_reason(strategy, what, why)
            )


def fullgraph_reason(strategy: str, what: str, why: str = "") -> str:
    """What ``torch.compile(..., fullgraph=True)`` reports (its error quotes the reason a
    disabled function gives): the warning's call is where the graph must break. ``why``:
    the compressors' own reasons for not running in the graph."""
    if what == "eager":
        return (
            f"torchstash: {strategy!r} is applied to this model and its codes do not run in a "
            f"compiled graph ({why or NOT_TRACEABLE}), so the model runs eagerly under "
            "torch.compile; fullgraph=True forbids that. Compile without fullgraph=True (memory "
            "is saved, as eagerly), do what the reason says, or remove() the strategy before "
            "compiling"
        )
    return (
        f"torchstash: {strategy!r} is applied to this model, which Module.compile() traces "
        "past its eager fallback: call torch.compile(model) instead, without fullgraph=True"
    )


def warn_compiled(module: nn.Module, what: str) -> None:
    """Warn once per model (dynamo calls this at run time where it met it while tracing)."""
    strategy = _STRATEGY.get(module, "the applied strategy")
    why = _WHY.get(module, "")
    _prepare(strategy, why)
    _DISABLED[f"warn:{strategy}:{what}:{why}"](module, what)


def _warn(module: nn.Module, what: str) -> None:
    if module in _WARNED:
        return
    _WARNED[module] = what
    strategy = _STRATEGY.get(module, "the applied strategy")
    if what == "eager":
        text = (
            f"torchstash: the codes of {strategy!r} do not run inside a torch.compile graph "
            f"({_WHY.get(module) or NOT_TRACEABLE}), so {type(module).__name__} runs eagerly "
            "under torch.compile: memory is saved as without compile, with no compile "
            "speed-up (docs/compile.md lists what runs in the graph)."
        )
    else:
        text = (
            f"torchstash: {type(module).__name__} was traced by torch.compile past the eager "
            f"fallback (e.g. through Module.compile()), so {strategy!r} does not compress what "
            "the compiled graph saves: it saves as stock PyTorch does. Call "
            "torch.compile(model) instead of model.compile() to keep the savings."
        )
    warnings.warn(text, CompileFallbackWarning, stacklevel=2)


def _eager_call_impl(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # Set on the instance (nn.Module.__call__ looks ``_call_impl`` up on it): dynamo reaches the
    # disabled call and runs the whole model, hooks included, eagerly.
    if compiling():
        warn_compiled(self, "eager")
    return _DISABLED["run"](self, *args, **kwargs)


#: per model class, the subclass an applied model of it takes (see :class:`EagerUnderCompile`)
_APPLIED: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()


def applied_class(cls: type) -> type:
    """A subclass of ``cls`` that adds nothing, under the same name: the class of a model a
    compressing strategy is applied to. Dynamo guards a compiled frame on its module's type,
    so a graph compiled for a stock model of ``cls`` (a copy compiled to compare, say) is
    never reused for the applied one, whose hooks that graph does not run: the strategy
    would silently do nothing."""
    if cls in _APPLIED.values():
        return cls
    sub = _APPLIED.get(cls)
    if sub is None:
        names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        sub = _APPLIED[cls] = type(cls.__name__, (cls,), names)
    return sub


class EagerUnderCompile:
    """Makes ``model`` run eagerly when a compiled function calls it; ``remove`` undoes it."""

    def __init__(self, model: nn.Module, strategy: str, why: Sequence[str] = ()) -> None:
        joined = "; ".join(why)
        _prepare(strategy, joined)
        self._model = weakref.ref(model)
        _STRATEGY[model] = strategy
        _WHY[model] = joined
        self._class = type(model)
        try:
            model.__class__ = applied_class(self._class)
        except TypeError:  # a class whose __init_subclass__ wants arguments: left as it is
            pass
        object.__setattr__(model, "_call_impl", _eager_call_impl.__get__(model))
        rebind_replicas(model)

    def remove(self) -> None:
        model = self._model()
        if model is None:
            return
        if type(model) is _APPLIED.get(self._class):
            model.__class__ = self._class
        model.__dict__.pop("_call_impl", None)
        unbind_replicas(model)
        _STRATEGY.pop(model, None)
        _WHY.pop(model, None)
        _WARNED.pop(model, None)


# -- the compiled path: the strategy inside the graph (torchstash.graphhooks) ------------------

#: an applied model's graph hooks and the engine they stand in for while a compiled call runs
_GRAPHED: weakref.WeakKeyDictionary[nn.Module, tuple[Any, Any]] = weakref.WeakKeyDictionary()


def _graph_entry(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # The applied model's ``__call__`` and ``_call_impl`` on the instance: the first frame a
    # compiled call of it runs. Dynamo skips this frame (see GraphUnderCompile) and compiles
    # the model's own call below it, with the graph hooks on: they cannot be entered inside
    # a traced frame, and must be on while the graph runs, where dynamo's guards look for
    # them. Dynamo would compile any Python frame this one calls: the entry's own work runs
    # in functions it is told to leave alone (``_ENTRY``).
    callback = _ENTRY["callback"]()
    if callback is None or callback is False or self not in _GRAPHED:
        return nn.Module._call_impl(self, *args, **kwargs)
    left = _ENTRY["enter"](self, args, kwargs)
    try:
        return nn.Module._call_impl(self, *args, **kwargs)
    finally:
        _ENTRY["leave"](left)


def _enter_graph(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The graph hooks on, the engine aside, for one compiled call of ``model`` (None where
    a stance runs it eagerly): what :func:`_leave_graph` closes."""
    if getattr(getattr(torch._dynamo.eval_frame, "_stance", None), "stance", "") == "force_eager":
        return None
    hooks, engine = _GRAPHED[model]
    stack = contextlib.ExitStack()
    import torch._functorch.config as functorch_config

    from .graphkeep import with_keep_exact

    told: dict[str, Any] = {
        "joint_custom_pass": with_keep_exact(
            functorch_config.joint_custom_pass, hooks.recomputes, hooks.declined
        )
    }
    if hasattr(functorch_config, "saved_tensors_hooks_filtering_mode"):
        # the hooks see what eager's see: the graph's inputs (the batch) and outputs too,
        # not only its intermediates ("donated"); never the parameters ("static")
        told["saved_tensors_hooks_filtering_mode"] = "no_static"
    if hooks.memory_budget is not None:
        told["activation_memory_budget"] = hooks.memory_budget
    stack.enter_context(functorch_config.patch(**told))
    called = signature(args, kwargs, model.training)
    stack.enter_context(hooks.entered(called, lambda: arguments(model, args, kwargs)))
    stack.enter_context(engine.in_graph())
    return stack


def signature(args: tuple[Any, ...], kwargs: dict[str, Any], training: bool) -> tuple[Any, ...]:
    """What a compiled call's saves depend on: its tensors' shapes, dtypes and devices, the
    model's mode and grad mode."""
    found: list[Any] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append((tuple(a.shape), a.dtype, a.device, a.requires_grad))
    return (tuple(found), tuple(sorted(kwargs)), training, torch.is_grad_enabled())


def arguments(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The compiled frame's arguments by name: the model's ``forward``'s parameters bound to
    the call (``{}`` where they do not bind)."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {}
    return dict(bound.arguments)


def _leave_graph(left: Any) -> None:
    if left is not None:
        left.close()


#: the entry and its helpers, made once dynamo is imported (at apply time)
_ENTRY: dict[str, Callable[..., Any]] = {}


def _entry() -> Callable[..., Any]:
    """:func:`_graph_entry`, its frame skipped by dynamo, and its helpers disabled (imports
    dynamo: at apply time)."""
    if not _ENTRY:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
        from torch._dynamo.decorators import skip

        _ENTRY["callback"] = get_eval_frame_callback
        _ENTRY["enter"] = torch.compiler.disable(_enter_graph)
        _ENTRY["leave"] = torch.compiler.disable(_leave_graph)
        _ENTRY["entry"] = skip(_graph_entry)
    return _ENTRY["entry"]


#: per model class, the subclass a model it compiles in the graph takes
_GRAPHED_CLASSES: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()


def graphed_class(cls: type) -> type:
    """As :func:`applied_class`, and where ``cls.forward`` is torch's own (an
    ``nn.Sequential`` model), a forward of its own that calls it: ``torch.compile`` then
    starts from the model's ``__call__`` (the graph entry) rather than inlining the call of a
    torch module from a frame of its own, where the entry would break the graph."""
    if cls in _GRAPHED_CLASSES.values():
        return cls
    sub = _GRAPHED_CLASSES.get(cls)
    if sub is None:
        names: dict[str, Any] = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        base_forward = cls.forward  # type: ignore[attr-defined]
        if getattr(base_forward, "__module__", "").startswith("torch."):

            def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
                return base_forward(self, *args, **kwargs)

            names["forward"] = forward
        sub = _GRAPHED_CLASSES[cls] = type(cls.__name__, (cls,), names)
    return sub


class GraphUnderCompile:
    """Makes ``model`` run its strategy inside the graph when a compiled function calls it
    (``torch.compile(model)`` or ``model.compile()``); eager calls are as before. ``remove``
    undoes it."""

    def __init__(self, model: nn.Module, hooks: Any, engine: Any) -> None:
        entry = _entry()
        self._model = weakref.ref(model)
        self._class = type(model)
        try:
            model.__class__ = graphed_class(self._class)
        except TypeError:  # a class whose __init_subclass__ wants arguments: left as it is
            pass
        _GRAPHED[model] = (hooks, engine)
        bound = entry.__get__(model)
        object.__setattr__(model, "_call_impl", bound)
        object.__setattr__(model, "__call__", bound)
        rebind_replicas(model)

    def remove(self) -> None:
        model = self._model()
        if model is None:
            return
        if type(model) is _GRAPHED_CLASSES.get(self._class):
            model.__class__ = self._class
        model.__dict__.pop("_call_impl", None)
        model.__dict__.pop("__call__", None)
        unbind_replicas(model)
        _GRAPHED.pop(model, None)


def graph_hooks_support() -> str:
    """What the installed torch offers the compiled path (docs/compile.md): saved-tensor hooks
    given as GraphModules, inlined by AOTAutograd, and the context that names each saved
    value's node while they are traced. Imports AOTAutograd (a second or so): for ``doctor``."""
    try:
        from torch._functorch._aot_autograd import graph_compile, utils
    except ImportError as e:
        return f"no: {e}"
    missing = [
        name
        for module, name in (
            (utils, "saved_tensors_hooks_are_inlineable"),
            (graph_compile, "_get_saved_tensor_hook_context"),
        )
        if not hasattr(module, name)
    ]
    if missing:
        return f"no: this torch lacks {', '.join(missing)}"
    return (
        "graph saved-tensor hooks: yes; strategies whose codes trace run inside the "
        "compiled graph, the others eagerly under torch.compile (docs/compile.md)"
    )
