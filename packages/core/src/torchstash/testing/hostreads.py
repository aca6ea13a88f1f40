"""Where a step reads a tensor's value on the host: a GPU-free gauge of host synchronisation.

On CUDA, ``.item()``, ``bool(t)``, ``.tolist()``, ``torch.equal`` and ``nonzero`` make the
host wait for the device (``tests/test_cuda_sync.py`` catches them with torch's sync debug
mode, on a GPU). On the CPU they cost nothing, so nothing would notice one added to a pack or
an unpack until a GPU run. :func:`host_reads` records every such call's Python stack on any
device, so a CPU test can hold the library to the same rule; :func:`unexplained` keeps the
stacks through none of the functions that read on purpose (:data:`KNOWN_HOST_READS`).
A tensor made from host values (``torch.tensor(list)``, ``torch.as_tensor``) counts too: on a
GPU it is a copy from pageable memory, which the host waits for. Run with the kernels off
(``TORCHSTASH_KERNELS=off``), the gauge holds the pure-PyTorch references to the rule as well:
they are what runs on CUDA for an op whose kernel is the CPU's only.
"""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["KNOWN_HOST_READS", "caller_frames", "device_waits", "host_reads", "unexplained"]

#: The functions that read a device value on purpose (``module:function``, the module by its
#: file's name), and why: each costs a CUDA step one wait for the device (their removal is
#: owed: docs/gpu.md).
KNOWN_HOST_READS = {
    "pool:pack_pool_positions": "quant's max-pool positions are checked to give the indices back",
    "groupwise:encode": "quant.int1 reads whether a group holds NaN or Inf (then 2 bits)",
}

#: Each host read that is patched: the tensor methods, then torch's functions
_TENSOR_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")
_TORCH_READS = ("equal", "nonzero")
_READS: tuple[tuple[Any, str], ...] = (
    *((torch.Tensor, name) for name in _TENSOR_READS),
    *((torch, name) for name in _TORCH_READS),
)
#: torch's functions that make a tensor from host values (a tensor argument is no copy)
_HOST_COPIES = ("tensor", "as_tensor")


@contextlib.contextmanager
def host_reads() -> Iterator[list[list[str]]]:
    """Inside, each host read appends its caller's stack (:func:`caller_frames`).
    Patches torch process-wide (one thread at a time), and puts everything back on exit."""
    found: list[list[str]] = []
    saved = [(owner, name, getattr(owner, name)) for owner, name in _READS]
    copies = [(torch, name, getattr(torch, name)) for name in _HOST_COPIES]

    def recording(original: Any) -> Any:
        def read(*args: Any, **kwargs: Any) -> Any:
            found.append(caller_frames())
            return original(*args, **kwargs)

        return read

    def copying(original: Any) -> Any:
        def copy(data: Any, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(data, torch.Tensor):
                found.append(caller_frames())
            return original(data, *args, **kwargs)

        return copy

    try:
        for owner, name, original in saved:
            setattr(owner, name, recording(original))
        for owner, name, original in copies:
            setattr(owner, name, copying(original))
        yield found
    finally:
        for owner, name, original in [*saved, *copies]:
            setattr(owner, name, original)


@contextlib.contextmanager
def device_waits() -> Iterator[list[list[str]]]:
    """On CUDA, inside, each call that waits for the device appends its Python stack
    (:func:`caller_frames`), as ``torch.cuda.set_sync_debug_mode("warn")`` sees it. The mode
    is process-wide and set back whatever happens; its own warning (the mode is a prototype)
    is not raised, so a suite that turns warnings into errors cannot leave it on."""
    found: list[list[str]] = []

    def show(message: object, *args: object, **kwargs: object) -> None:
        if "called a synchronizing CUDA operation" in str(message):
            found.append(caller_frames())

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        try:
            torch.cuda.set_sync_debug_mode("warn")
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")


def caller_frames() -> list[str]:
    """The calling stack as ``module:function`` (innermost last), less the caller itself and
    the warnings module's frames (a sync warning's stack passes through them)."""
    stack = traceback.extract_stack()[:-2]
    names = [(os.path.basename(f.filename).removesuffix(".py"), f.name) for f in stack]
    return [f"{module}:{name}" for module, name in names if module != "warnings"]


def unexplained(stacks: Iterable[list[str]], known: Iterable[str] = KNOWN_HOST_READS) -> list[str]:
    """The stacks that pass through none of ``known``'s functions, as 'a > b > c' (the last
    eight frames)."""
    allowed = set(known)
    return [" > ".join(s[-8:]) for s in stacks if not allowed & set(s)]
