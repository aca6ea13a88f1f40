"""Drop-in for memsave_torch's users: ``import torchstash_memsave.compat as memsave_torch``,
then ``memsave_torch.nn.convert_to_memory_saving(model)``, the ``MemSave*`` layers with their
``from_nn_*`` constructors and ``memsave_torch.nn.functional``'s ``*MemSave`` functions."""

from __future__ import annotations

from . import nn
from .convert import convert_to_memory_saving, recursive_setattr

__all__ = ["convert_to_memory_saving", "nn", "recursive_setattr"]
