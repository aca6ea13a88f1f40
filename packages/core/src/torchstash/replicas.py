"""``nn.DataParallel``'s replicas of a module with methods of ours on its instance.

Its replication copies each module's ``__dict__`` into a new instance: a method bound there to
the module (a call entry, :mod:`.modulecalls`; the applied model's compile entry,
:mod:`.compiling`) would make every replica call the original, on the original's device. The
module's own ``_replicate_for_data_parallel`` rebinds those methods to each replica.
"""

from __future__ import annotations

import types

from torch import nn


def _replicate(self: nn.Module) -> nn.Module:
    # The module's ``_replicate_for_data_parallel`` (on the instance): the class's copy, then
    # the copied bound methods of ours rebound to the replica.
    replica = type(self)._replicate_for_data_parallel(self)
    for name in ("_call_impl", "__call__", "_replicate_for_data_parallel"):
        bound = replica.__dict__.get(name)
        if isinstance(bound, types.MethodType) and bound.__self__ is self:
            replica.__dict__[name] = types.MethodType(bound.__func__, replica)
    return replica


def rebind_replicas(module: nn.Module) -> None:
    """Make ``nn.DataParallel``'s replicas of ``module`` call themselves: its replication
    copies the instance's ``__dict__``, where an entry is a method bound to ``module``."""
    if "_replicate_for_data_parallel" not in module.__dict__:
        object.__setattr__(
            module, "_replicate_for_data_parallel", types.MethodType(_replicate, module)
        )


def unbind_replicas(module: nn.Module) -> None:
    """Undo :func:`rebind_replicas` (the entries are off)."""
    bound = module.__dict__.get("_replicate_for_data_parallel")
    if isinstance(bound, types.MethodType) and bound.__func__ is _replicate:
        del module.__dict__["_replicate_for_data_parallel"]
