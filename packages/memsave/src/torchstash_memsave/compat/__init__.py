"""Drop-in for memsave_torch's users: ``convert_to_memory_saving`` (and the ``MemSave*``
layer classes with their ``from_nn_*`` constructors, exported by the package)."""

from __future__ import annotations

from .convert import convert_to_memory_saving

__all__ = ["convert_to_memory_saving"]
