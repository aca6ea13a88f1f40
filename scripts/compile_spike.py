"""The compiled path's spike: an 8-bit code inside ``torch.compile``'s graphs.

Pack and unpack are ``torch.fx.GraphModule`` saved-tensor hooks, which AOTAutograd inlines
into the compiled forward (pack at its end) and backward (unpack at its start); the code is
the shared kernels' ``torchstash::group_quantize`` / ``group_dequantize`` (their fake kernels
let them trace). Per model: the gradient cosine with compiled stock's, the step over compiled
stock's (taking turns, median), and what the graph holds (the heap gauge,
:func:`torchstash.testing.heap.held_by_graph`), compiled stock against compiled with the hooks.
It also prints what the hooks are told of each saved value (its node, the module stack) while
AOTAutograd traces them: what op-aware choices would read.

    python scripts/compile_spike.py          # inductor, CPU, one thread, about a minute
    python scripts/compile_spike.py --device cuda --scale base   # held: CUDA's allocator

Round to nearest (the kernel's seed is a plain integer, a constant in a compiled graph); every
float32 tensor of 4096 elements or more is coded, whatever its op. See docs/compile.md.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import nn

from torchstash.kernels import loader
from torchstash.testing import heap
from torchstash.testing.models import ZooEntry, zoo

GROUP = 256
MIN_NUMEL = 4096
SEEN: list[tuple[str, str, str]] = []


def _context() -> dict[str, object] | None:
    from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context

    return _get_saved_tensor_hook_context()


def _pack(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    ctx = _context()
    if ctx is not None:
        node: Any = ctx["_node"]  # the torch.fx node that saved ``x``
        stack = list(getattr(node, "meta", {}).get("nn_module_stack", {}).values())
        SEEN.append((node.name, str(node.target), stack[-1][0] if stack else ""))
    if x.dtype != torch.float32 or x.numel() < MIN_NUMEL:
        return (x.detach(),)  # never the tensor itself: see docs/compile.md
    codes, lo, step = torch.ops.torchstash.group_quantize(x.reshape(-1), 8, GROUP, 0, False)
    shape = x.new_empty(1, dtype=torch.uint8).expand(x.shape)  # carries the shape, 1 byte
    return (codes, lo, step, shape)


def _unpack(packed: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if len(packed) == 1:
        return packed[0]
    codes, lo, step, shape = packed
    flat = torch.ops.torchstash.group_dequantize(
        codes, lo, step, 8, GROUP, shape.numel(), torch.float32
    )
    return flat.view(shape.shape)


torch.fx.wrap("_pack")
torch.fx.wrap("_unpack")


def pack_hook(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _pack(x)


def unpack_hook(packed: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return _unpack(packed)


HOOKS = (torch.fx.symbolic_trace(pack_hook), torch.fx.symbolic_trace(unpack_hook))


def measure(
    name: str,
    build: Callable[[], nn.Module],
    loss: Callable[[nn.Module], torch.Tensor],
    device: torch.device,
) -> None:
    torch.manual_seed(0)
    model = build().to(device)
    stock = copy.deepcopy(model)
    compiled_stock = torch.compile(stock, fullgraph=True)
    compiled = torch.compile(model, fullgraph=True)

    def forward(m: nn.Module, hooked: bool) -> torch.Tensor:
        if not hooked:
            return loss(m)
        with torch.autograd.graph.saved_tensors_hooks(*HOOKS):
            return loss(m)

    def step(m: nn.Module, hooked: bool) -> None:
        m.zero_grad(set_to_none=True)
        forward(m, hooked).backward()

    SEEN.clear()
    step(compiled_stock, False)
    step(compiled, True)
    a = torch.cat([p.grad.flatten() for p in stock.parameters()]).double()
    b = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
    cosine = float(a @ b / (a.norm() * b.norm()))
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(13):
        for hooked in (False, True):
            m = compiled if hooked else compiled_stock
            _sync(device)
            t = time.perf_counter()
            step(m, hooked)
            _sync(device)
            if i >= 3:
                times[hooked].append(time.perf_counter() - t)
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    held_stock, _ = held(lambda: forward(compiled_stock, False), device)
    held_hooked, kept = held(lambda: forward(compiled, True), device)
    print(
        f"{name:8s} cosine {cosine:.5f}  step {ratio:.2f}x compiled stock  held "
        f"{held_stock / 1e6:.2f} MB -> {held_hooked / 1e6:.2f} MB  (dropped unused: "
        f"{kept / 1e6:.2f} MB stays; {len(SEEN)} saved values hooked; e.g. {SEEN[:1]})"
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int:
    """Bytes the device's allocator has handed out (the CPU's: glibc's heap)."""
    if device.type == "cuda":
        _sync(device)
        return torch.cuda.memory_allocated(device)
    return heap.heap_bytes()


def held(forward: Callable[[], torch.Tensor], device: torch.device) -> tuple[int, int]:
    """(the memory a warm forward's loss holds, what stays once the loss is dropped unused)."""
    gc.collect()
    before = _allocated(device)
    loss = forward()
    gc.collect()
    alive = _allocated(device)
    del loss
    gc.collect()
    return alive - before, _allocated(device) - before


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--scale", default="small", help="the zoo's scale (default: small)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    loader.require(device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # the heap gauge reads one thread's allocations
    x = torch.randn(64, 256, device=device)

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))

    measure("mlp", mlp, lambda m: m(x).square().sum(), device)
    for entry in zoo(args.scale):
        inputs, targets = entry.batch(entry.batch_size, device)
        loss = functools.partial(_zoo_loss, entry, inputs, targets)
        measure(entry.name, entry.build, loss, device)


def _zoo_loss(
    entry: ZooEntry, inputs: torch.Tensor, targets: torch.Tensor, m: nn.Module
) -> torch.Tensor:
    return entry.loss(m, inputs, targets)


if __name__ == "__main__":
    main()
