"""ActNN's and GACT's memory helpers (``get_memory_usage``, ``compute_tensor_bytes``, the
experiment recorder), shared by both drop-ins.

Both reported bytes from ``torch.cuda.memory_allocated``; here too on CUDA. On a machine
without CUDA there is no device allocator to ask, and a silent 0 would read as "nothing
used": ``get_memory_usage`` raises and points to ``torchstash.measure``, which counts what
autograd saves exactly on any device.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch

MB = 1024 * 1024


def get_memory_usage(print_info: bool = False, device: Any = None) -> int:
    """Bytes allocated by tensors on the CUDA device (the current one); with ``print_info``,
    allocated and reserved MB are printed too."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "get_memory_usage reads the CUDA allocator, and no CUDA device is visible here; "
            "torchstash.measure(model, step, strategy) counts the bytes saved for backward "
            "on any device"
        )
    allocated = int(torch.cuda.memory_allocated(device))
    if print_info:
        reserved = torch.cuda.memory_reserved(device)
        print(f"allocated: {allocated / MB:.2f} MB", flush=True)
        print(f"reserved:  {reserved / MB:.2f} MB", flush=True)
    return allocated


def compute_tensor_bytes(tensors: torch.Tensor | Iterable[Any]) -> int:
    """Bytes of the tensors' elements (every dtype at its own size; ActNN counted int64 and
    bool as 0 bytes and GACT exited on them); a Python int counts 4, as GACT counted it."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
        elif isinstance(t, int) and not isinstance(t, bool):
            total += 4
    return total


def empty_cache(ratio: float | None) -> None:
    """Give cached CUDA blocks back when less than ``ratio`` of the reserved memory is used."""
    if ratio is None or not torch.cuda.is_available():
        return
    reserved = torch.cuda.memory_reserved()
    if reserved > 0 and torch.cuda.memory_allocated() / reserved < ratio:
        torch.cuda.empty_cache()


def swap_to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in (pinned, where CUDA is there) host memory."""
    pinned = torch.cuda.is_available()
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pinned)
    out.copy_(tensor, non_blocking=pinned)
    return out


def disable_cache_allocator() -> None:
    os.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"


def enable_cache_allocator() -> None:
    os.environ.pop("PYTORCH_NO_CUDA_MEMORY_CACHING", None)


class GlobalExpRecorder:
    """Named results of an experiment, appended to a file as one JSON line per ``dump``."""

    def __init__(self) -> None:
        self.val_dict: OrderedDict[str, Any] = OrderedDict()

    def record(self, key: str, value: Any, float_round: int = 6) -> None:
        if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
            value = value.item()  # a numpy or torch scalar
        if isinstance(value, float):
            value = round(value, float_round)
        self.val_dict[key] = value

    def dump(self, filename: str) -> None:
        with open(filename, "a") as f:
            f.write(json.dumps(self.val_dict) + "\n")
        print(f"Save exp results to {filename}")

    def clear(self) -> None:
        self.val_dict.clear()


exp_recorder = GlobalExpRecorder()
