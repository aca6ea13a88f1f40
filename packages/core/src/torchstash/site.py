"""Where a tensor is saved: the module, the op, and the tensor's role in that op."""

from __future__ import annotations

from dataclasses import dataclass


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
    #: the raw function name (``__matmul__``, ``bmm``, ``conv2d``)
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

    @property
    def key(self) -> str:
        """A stable identity for state kept per site (running estimates, allocations)."""
        return f"{self.module}#{self.call}:{self.op}{self.op_index}:{self.role}:{self.ordinal}"

    def describe(self) -> str:
        where = self.module or "<top level>"
        what = f"{self.op}.{self.role}" if self.op else (self.role or "tensor")
        return f"{what} saved in {where} ({self.module_type or 'no module'})"
