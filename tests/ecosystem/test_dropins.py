"""The drop-ins as the seeds' users call them, on the models those users trained: DropIT's
DeiT benchmark (``patch_embed.proj`` and ``head`` opted out, ``to_dropit(model, strategy,
gamma, autocast)``) and its GPT-2 (Hugging Face ``Conv1D``)."""

from __future__ import annotations

import pytest
import torch

import torchstash as ts
from torchstash_bench.ecosystem import MODELS, Unavailable, fresh, gradients, library, loss_at


def _model(name: str) -> torch.nn.Module:
    try:
        library(MODELS[name].library)
    except Unavailable as e:
        pytest.skip(str(e))
    return fresh(MODELS[name])


def _step(name: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_at(MODELS[name], model, 0).backward()
    return gradients(model)


def test_dropit_deit_benchmark_call() -> None:
    import torchstash_dropit.compat as dropit

    model = _model("timm-deit")
    stock = _step("timm-deit", model)
    model.patch_embed.proj.no_dropit = True
    model.head.no_dropit = True
    model = dropit.to_dropit(model, "mink", 0.7, False)
    got = _step("timm-deit", model)
    assert torch.equal(got["patch_embed.proj.weight"], stock["patch_embed.proj.weight"])
    assert torch.equal(got["head.weight"], stock["head.weight"])
    qkv = "blocks.0.attn.qkv.weight"
    assert not torch.equal(got[qkv], stock[qkv])
    assert all(g.isfinite().all() for g in got.values())
    cos = torch.nn.functional.cosine_similarity(got[qkv].flatten(), stock[qkv].flatten(), 0)
    assert cos > 0.5, float(cos)


def test_dropit_gpt2_conv1d() -> None:
    import torchstash_dropit.compat as dropit

    model = _model("hf-gpt2")
    stock = _step("hf-gpt2", model)
    dropit.to_dropit(model, "mink", 0.9, False)
    got = _step("hf-gpt2", model)
    name = "transformer.h.0.mlp.c_fc.weight"
    assert not torch.equal(got[name], stock[name])
    bias = "transformer.h.0.mlp.c_fc.bias"
    assert torch.equal(got[bias], stock[bias])  # only weight gradients see the drop
    ts.remove(model)
    assert torch.equal(_step("hf-gpt2", model)[name], stock[name])
