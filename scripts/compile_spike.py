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

Round to nearest (the kernel's seed is a plain integer, a constant in a compiled graph); every
float32 tensor of 4096 elements or more is coded, whatever its op. See docs/compile.md.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from collections.abc import Callable

import torch
import torch.fx
from torch import nn

from torchstash.kernels import loader
from torchstash.testing import heap
from torchstash.testing.models import zoo

GROUP = 256
MIN_NUMEL = 4096
SEEN: list[tuple[str, str, str]] = []


def _context() -> dict[str, object] | None:
    from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context

    return _get_saved_tensor_hook_context()


def _pack(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    ctx = _context()
    if ctx is not None:
        node = ctx["_node"]
        stack = list(getattr(node, "meta", {}).get("nn_module_stack", {}).values())
        SEEN.append((node.name, str(node.target), stack[-1][0] if stack else ""))  # type: ignore[union-attr]
    if x.dtype != torch.float32 or x.numel() < MIN_NUMEL:
        return (x,)
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
    name: str, build: Callable[[], nn.Module], loss: Callable[[nn.Module], torch.Tensor]
) -> None:
    torch.manual_seed(0)
    model = build()
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
            t = time.perf_counter()
            step(m, hooked)
            if i >= 3:
                times[hooked].append(time.perf_counter() - t)
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    held_stock, _ = held(lambda: forward(compiled_stock, False))
    held_hooked, kept = held(lambda: forward(compiled, True))
    print(
        f"{name:8s} cosine {cosine:.5f}  step {ratio:.2f}x compiled stock  held "
        f"{held_stock / 1e6:.2f} MB -> {held_hooked / 1e6:.2f} MB  (dropped unused: "
        f"{kept / 1e6:.2f} MB stays; {len(SEEN)} saved values hooked; e.g. {SEEN[:1]})"
    )


def held(forward: Callable[[], torch.Tensor]) -> tuple[int, int]:
    """(the heap a warm forward's loss holds, what stays once the loss is dropped unused)."""
    gc.collect()
    before = heap.heap_bytes()
    loss = forward()
    gc.collect()
    alive = heap.heap_bytes()
    del loss
    gc.collect()
    return alive - before, heap.heap_bytes() - before


def main() -> None:
    loader.require("cpu")
    torch.set_num_threads(1)
    x = torch.randn(64, 256)

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))

    measure("mlp", mlp, lambda m: m(x).square().sum())
    for entry in zoo("small"):
        inputs, targets = entry.batch(entry.batch_size, torch.device("cpu"))
        measure(entry.name, entry.build, lambda m, e=entry, i=inputs, t=targets: e.loss(m, i, t))


if __name__ == "__main__":
    main()
