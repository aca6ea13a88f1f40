"""Multi-process training on CPU (gloo, 2 processes): DDP and FSDP2 with a strategy applied.

A lossless strategy leaves every gradient as stock's under DDP, bit for bit, and equal to one
process on the whole batch up to the all-reduce's rounding; a lossy one trains (finite
gradients, same on every rank).
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torchstash as ts
from torchstash.testing.models import zoo

WORLD = 2
LOSSLESS = [s for s in ("none", "offload.cpu", "memsave") if s in ts.REGISTRY.names()]
LOSSY = [s for s in ("quant.int8", "dropit.mink") if s in ts.REGISTRY.names()]

pytestmark = pytest.mark.skipif(
    not dist.is_available() or sys.platform == "win32", reason="needs torch.distributed (gloo)"
)


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _worker(rank: int, init: str, model_name: str, strategy: str, wrap: str, out: str) -> None:
    try:
        dist.init_process_group(
            "gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
        )
        torch.set_num_threads(1)
        entry = next(e for e in zoo("tiny") if e.name == model_name)
        x, y = entry.batch(4, torch.device("cpu"))
        shard = slice(rank * 2, rank * 2 + 2)
        results: dict[str, Any] = {}
        for label, strat in (("stock", None), ("ours", strategy)):
            torch.manual_seed(0)
            model = entry.build()
            handle = ts.apply(model, strat) if strat else None
            if wrap.startswith("ddp"):
                net: Any = torch.nn.parallel.DistributedDataParallel(model)
                if wrap == "ddp-compiled":
                    net = torch.compile(net, backend="aot_eager")
            else:
                from torch.distributed.fsdp import fully_shard

                net = fully_shard(model)
            entry.loss(net, x[shard], y[shard]).backward()
            if wrap == "fsdp":  # sharded gradients: gather them for the comparison
                results[label] = [
                    p.grad.full_tensor().clone() for p in model.parameters() if p.grad is not None
                ]
            else:
                results[label] = _grads(model)
            if handle is not None:
                graph = handle.graph
                results["coded"] = sum(1 for d in graph.decisions if d.compressor) if graph else 0
                results["stored"] = handle.tally.stored_bytes
                results["raw"] = handle.tally.raw_bytes
                handle.remove()
        if rank == 0:
            torch.save(results, out)
        dist.barrier()  # both ranks done before either tears gloo down
        dist.destroy_process_group()
    except Exception:
        Path(out + f".err{rank}").write_text(traceback.format_exc())
        raise
    # Leave without the interpreter's teardown: gloo's threads may still be winding down there
    # and abort the process ("terminate called without an active exception") after the work.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(model_name: str, strategy: str, wrap: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        out = os.path.join(tmp, "result.pt")
        try:
            mp.spawn(_worker, (init, model_name, strategy, wrap, out), nprocs=WORLD, join=True)
        except Exception as e:
            errors = [p.read_text() for p in Path(tmp).glob("result.pt.err*")]
            raise AssertionError("\n".join(errors) or str(e)) from e
        result: dict[str, Any] = torch.load(out)
        return result


def _single_process(model_name: str) -> list[torch.Tensor]:
    entry = next(e for e in zoo("tiny") if e.name == model_name)
    x, y = entry.batch(4, torch.device("cpu"))
    torch.manual_seed(0)
    model = entry.build()
    entry.loss(model, x, y).backward()
    return _grads(model)


@pytest.mark.parametrize("strategy", LOSSLESS)
def test_ddp_lossless_equals_stock_ddp_and_one_process(strategy: str) -> None:
    r = _run("gpt", strategy, "ddp")
    assert len(r["ours"]) == len(r["stock"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(r["stock"], r["ours"]))
    for a, b in zip(_single_process("gpt"), r["ours"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("strategy", LOSSY)
def test_ddp_lossy_trains_and_saves(strategy: str) -> None:
    r = _run("gpt", strategy, "ddp")
    assert all(g.isfinite().all() for g in r["ours"])
    assert r["stored"] < r["raw"]


def test_ddp_memsave_resnet_equals_stock_ddp() -> None:
    if "memsave" not in LOSSLESS:
        pytest.skip("torchstash-memsave is not installed")
    r = _run("resnet", "memsave", "ddp")
    assert all(torch.equal(a, b) for a, b in zip(r["stock"], r["ours"]))


@pytest.mark.parametrize(("model_name", "strategy"), [("gpt", "none"), ("resnet", "memsave")])
def test_fsdp2_lossless_equals_stock_fsdp2(model_name: str, strategy: str) -> None:
    if strategy not in LOSSLESS:
        pytest.skip(f"{strategy} is not installed")
    r = _run(model_name, strategy, "fsdp")
    assert len(r["ours"]) == len(r["stock"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(r["stock"], r["ours"]))
    if model_name == "gpt":  # no BatchNorm: the shards' mean gradient is the whole batch's
        for a, b in zip(_single_process("gpt"), r["ours"]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_ddp_compiled_codes_in_the_graph() -> None:
    """``torch.compile(DDP(model))`` on an applied model: the strategy's codes run inside the
    compiled graph on each rank, and the all-reduced gradients stay near stock's."""
    if "quant.int8" not in LOSSY:
        pytest.skip("torchstash-quant is not installed")
    r = _run("gpt", "quant.int8", "ddp-compiled")
    assert r["coded"] > 0 and 0 < r["stored"] < r["raw"]
    a = torch.cat([g.flatten() for g in r["stock"]]).double()
    b = torch.cat([g.flatten() for g in r["ours"]]).double()
    assert float(a @ b / (a.norm() * b.norm())) > 0.999
