"""Where a tensor is saved: the module, the op, the call's arguments, and the tensor's role."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

_NO_KWARGS: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True, slots=True, eq=False)
class OpCall:
    """The torch call saving a tensor, as a strategy may read it while that call runs.

    The engine fills it for every save, so a compressor, a policy or a test reads the op's
    arguments from the :class:`Site` it is given (a pooling's kernel size, a GELU's
    ``approximate``, whether a matmul multiplies a Parameter) instead of from global state.
    It holds the call's arguments, so it lives only while the call does: the engine keeps
    no site with its call beyond ``compress``.
    """

    #: the call's positional arguments (tensors, sizes, flags) as the op received them
    args: tuple[Any, ...] = ()
    #: its keyword arguments (read-only)
    kwargs: Mapping[str, Any] = field(default_factory=lambda: _NO_KWARGS)
    #: tells the engine's tracker to call back with the op's result (see :meth:`on_result`)
    notify: Callable[[Callable[[Any], None]], None] | None = field(default=None, repr=False)

    def argument(self, name: str, position: int, default: Any = None) -> Any:
        """An argument by keyword or position: ``call.argument("approximate", 1, "none")``."""
        if name in self.kwargs:
            return self.kwargs[name]
        if len(self.args) > position:
            return self.args[position]
        return default

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The call's tensor arguments, in order."""
        return tuple(a for a in self.args if isinstance(a, torch.Tensor))

    @property
    def has_parameter(self) -> bool:
        """True when an argument is a Parameter (a matmul with one is a linear layer)."""
        return any(isinstance(a, torch.nn.Parameter) for a in self.args)

    def position(self, t: torch.Tensor, among: int = 3) -> int | None:
        """Which of the first ``among`` arguments ``t`` is exactly (see :func:`position`)."""
        return position(t, self.args, among)

    def on_result(self, callback: Callable[[Any], None]) -> None:
        """Have ``callback(result)`` called when this call returns (a save happens inside the
        op, before its output exists: to watch the output's gradient, say). Dropped for a
        call the engine does not track (a site built by hand)."""
        if self.notify is not None:
            self.notify(callback)


def position(t: torch.Tensor, args: Sequence[Any], among: int = 3) -> int | None:
    """Which of the first ``among`` of ``args`` ``t`` is exactly (address, shape, strides), or
    None: a fused attention's ``q``, ``k``, ``v`` split from one projection share a storage
    (and its kernel saves ``k`` first), so only this tells them apart."""
    for i, a in enumerate(args[:among]):
        if (
            isinstance(a, torch.Tensor)
            and a.data_ptr() == t.data_ptr()
            and a.shape == t.shape
            and a.stride() == t.stride()
        ):
            return i
    return None


#: The call of a save no op made (or of a site built by hand): no arguments.
NO_CALL = OpCall()


@dataclass(slots=True)
class Site:
    """Treat as immutable (``dataclasses.replace`` for a variant); not frozen because a frozen
    dataclass costs five times as much to build, and one is built for every saved tensor."""

    #: qualified name of the innermost module running (``""`` for the root or outside a model)
    module: str = ""
    #: type tag of that module (see :mod:`torchstash.tags`), ``""`` outside a model
    tag: str = ""
    #: class name of that module
    module_type: str = ""
    #: index of that module among the model's modules with the same tag
    module_index: int = -1
    #: canonical name of the op that saved the tensor (``linear``, ``matmul``, ``softmax``, ...)
    op: str = ""
    #: the raw function name (``__matmul__``, ``bmm``, ``conv2d``; ``memsave.relu`` for a
    #: plug-in's own op)
    func: str = ""
    #: occurrence index of this op in the current forward
    op_index: int = -1
    #: the tensor's role in that op: ``input``, ``arg1``, ``arg2``... or ``output``
    role: str = ""
    #: ordinal of this tensor among those saved by the same op call
    ordinal: int = 0
    #: which call of the module in this step (a shared module is called several times)
    call: int = 0
    #: that module's ``training`` flag (True outside a module): a strategy that changes
    #: gradients on purpose (dropping values) can leave eval-mode passes exact
    training: bool = True
    #: the op call's arguments, while it runs (:data:`NO_CALL` in the sites the engine keeps)
    opcall: OpCall = field(default=NO_CALL, compare=False, repr=False)
    #: on a replayed save, what its compressor noted of the call when the save was recorded
    #: (its ``recall``: a max pool's geometry); None otherwise
    recalled: Any = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> str:
        """A stable identity for state kept per site (running estimates, allocations)."""
        return f"{self.module}#{self.call}:{self.op}{self.op_index}:{self.role}:{self.ordinal}"

    def describe(self) -> str:
        where = self.module or "<top level>"
        what = f"{self.op}.{self.role}" if self.op else (self.role or "tensor")
        return f"{what} saved in {where} ({self.module_type or 'no module'})"
