"""``offload.cpu``: saved tensors go to pinned host memory on a side stream and come back early.

Compared with ``torch.autograd.graph.save_on_cpu`` it never blocks the host in forward (the copy
runs on a side stream, ordered by events) and, in backward, copies the next tensors back while
the current op computes (``prefetch`` tensors ahead). On a CPU tensor it declines: the data is
already in host memory, so the strategy is an identity there.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from .compressor import BaseCompressor
from .layout import contiguous_strides, dense_strides
from .packed import Packed
from .site import Site


class CpuOffload(BaseCompressor):
    name = "offload.cpu"
    lossless = True

    def __init__(self, prefetch: int = 2, pin_memory: bool = True) -> None:
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"offload.cpu: prefetch must be an int >= 0, got {prefetch!r}")
        self.prefetch = prefetch
        self.pin_memory = pin_memory
        self._streams: dict[torch.device, Any] = {}
        self._lock = threading.Lock()
        # Pack order per device, for prefetching in backward (reverse order).
        self._order: dict[torch.device, list[weakref.ref[Packed]]] = {}
        self._ready: weakref.WeakKeyDictionary[Packed, tuple[torch.Tensor, Any]] = (
            weakref.WeakKeyDictionary()
        )
        self._copied: weakref.WeakKeyDictionary[Packed, Any] = weakref.WeakKeyDictionary()

    def unsupported(self, x: torch.Tensor, site: Site) -> list[str]:
        reasons = []
        if not (x.is_floating_point() or x.is_complex()):
            reasons.append(
                f"offload.cpu moves floating-point tensors; this one is {x.dtype} (the engine "
                "keeps integer and bool saves as they are)"
            )
        if x.device.type != "cuda":
            reasons.append(
                f"offload.cpu moves accelerator tensors to host memory; this one is on "
                f"{x.device.type} already (an identity here)"
            )
        return reasons

    def _stream(self, device: torch.device) -> Any:
        with self._lock:
            s = self._streams.get(device)
            if s is None:
                s = self._streams[device] = torch.cuda.Stream(device)
            return s

    def compress(self, x: torch.Tensor, site: Site) -> Packed:
        side = self._stream(x.device)
        current = torch.cuda.current_stream(x.device)
        # the host copy keeps a dense tensor's strides, so the copy back has them too
        strides = dense_strides(x) or contiguous_strides(x.shape)
        host = torch.empty_strided(x.shape, strides, dtype=x.dtype, pin_memory=self.pin_memory)
        side.wait_stream(current)  # x is complete before the copy starts
        with torch.cuda.stream(side):
            host.copy_(x, non_blocking=self.pin_memory)
            done = torch.cuda.Event()
            done.record(side)
        x.record_stream(side)  # the allocator keeps x until the copy has read it
        packed = Packed.like(x, self.name, data=host)
        self._copied[packed] = done
        with self._lock:
            order = self._order.setdefault(x.device, [])
            order[:] = [r for r in order if r() is not None]
            order.append(weakref.ref(packed))
        return packed

    def _to_device(self, packed: Packed) -> tuple[torch.Tensor, Any]:
        host = packed.tensors["data"]
        assert isinstance(host, torch.Tensor)
        side = self._stream(packed.device)
        with torch.cuda.stream(side):
            copied = self._copied.get(packed)
            if copied is not None:
                side.wait_event(copied)  # the D2H copy finished writing host
            out = host.to(packed.device, non_blocking=self.pin_memory)
            ready = torch.cuda.Event()
            ready.record(side)
        return out, ready

    def decompress(self, packed: Packed) -> torch.Tensor:
        hit = self._ready.pop(packed, None)
        out, ready = hit if hit is not None else self._to_device(packed)
        current = torch.cuda.current_stream(packed.device)
        current.wait_event(ready)
        out.record_stream(current)
        self._prefetch_before(packed)
        return out

    def _prefetch_before(self, packed: Packed) -> None:
        """Start copying back the tensors saved just before this one: backward needs them next."""
        if not self.prefetch:
            return
        with self._lock:
            order = self._order.get(packed.device, [])
            refs = [r() for r in order]
        try:
            i = next(k for k, p in enumerate(refs) if p is packed)
        except StopIteration:
            return
        for p in reversed(refs[max(0, i - self.prefetch) : i]):
            if p is not None and p not in self._ready:
                self._ready[p] = self._to_device(p)
