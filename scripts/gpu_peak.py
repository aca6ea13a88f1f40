"""What is alive on the GPU at a training step's peak, by the code that allocated it.

Records the CUDA allocator's history over one warm step of a zoo model under each strategy,
replays the allocations and frees to find the peak, and sums the blocks alive there by their
innermost torchstash (else user) frame. Answers "why does strategy A peak above strategy B
while storing less" with the lines that hold the difference.

    python scripts/gpu_peak.py --model gpt --scale base --strategies stock,quant.int2,quant.int1
"""

from __future__ import annotations

import argparse
import collections
from typing import Any

import torch

import torchstash
from torchstash.testing.models import zoo


def _site(frames: list[dict[str, Any]]) -> str:
    """The innermost frame inside torchstash (else inside the model), as file:line function."""
    for want in ("torchstash", "testing/models"):
        for f in frames:
            name = f.get("filename", "")
            if want in name and "gpu_peak" not in name:
                return f"{name.split('/src/')[-1]}:{f.get('line')} {f.get('name')}"
    return "(outside torchstash)"


def alive_at_peak(trace: list[dict[str, Any]]) -> tuple[int, dict[str, int], int]:
    """(peak bytes over the trace, bytes alive at the peak by site, allocations counted)."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in trace:
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[addr] = (size, _site(event.get("frames", [])))
            total += size
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_completed" and addr in live:
            total -= live.pop(addr)[0]
    by_site: dict[str, int] = collections.Counter()
    for size, site in at_peak.values():
        by_site[site] += size
    return peak, dict(by_site), len(trace)


def measure(entry: Any, strategy: str, device: torch.device) -> tuple[int, int, dict[str, int]]:
    torch.manual_seed(0)
    model = entry.build().to(device)
    if strategy != "stock":
        torchstash.apply(model, strategy)
    inputs, targets = entry.batch(entry.batch_size, device)

    def step() -> None:
        entry.loss(model, inputs, targets).backward()
        model.zero_grad(set_to_none=True)

    for _ in range(3):  # warm: plans measured, codes recorded
        step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    step()
    torch.cuda.synchronize(device)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated(device) - base
    trace = snapshot["device_traces"][device.index or 0]
    traced_peak, by_site, _ = alive_at_peak(trace)
    return peak, traced_peak, by_site


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt")
    p.add_argument("--scale", default="base")
    p.add_argument("--strategies", default="stock,quant.int2,quant.int1")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    device = torch.device("cuda")
    entry = next(e for e in zoo(args.scale) if e.name == args.model)
    for strategy in args.strategies.split(","):
        peak, traced, by_site = measure(entry, strategy, device)
        print(
            f"\n{args.model} {strategy}: step peak above the weights {peak / 2**20:.1f} MiB "
            f"(traced step: {traced / 2**20:.1f} MiB alive at its peak), by site:"
        )
        for site, size in sorted(by_site.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {size / 2**20:9.1f} MiB  {site}")


if __name__ == "__main__":
    main()
