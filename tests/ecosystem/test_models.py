"""Every registered strategy on the models users bring: Hugging Face transformers (GPT-2, BERT,
ViT, Llama), timm (DeiT, ResNet-10t, ConvNeXt-atto, EfficientNet-B0) and torchvision
(ResNet-18, MobileNetV3-small, ViT-B/16), each built from a config with random weights
(nothing is downloaded; :mod:`torchstash_bench.ecosystem`) and skipped with a reason where its
library is not installed.

Per (model, strategy): a few SGD steps train (finite loss and gradients); the saved bytes of
the first step are stock's exactly for the strategies that are identities here, and below
stock's for the ones that compress something on that model; a lossless strategy's first
gradients equal stock's bit for bit, a lossy one's are within its tolerance
(:data:`MIN_COSINE`); ``remove`` gives back the same modules, ``state_dict`` keys and
training step (loss and gradients) as a stock model with the same weights.
"""

from __future__ import annotations

import math
from functools import cache

import pytest
import torch
from torch import nn

import torchstash as ts
from torchstash.engine import CONSTANT_REASON
from torchstash.errors import NothingToRewriteWarning
from torchstash.testing.hooks import hook_total
from torchstash_bench.common import lossless_of
from torchstash_bench.ecosystem import (
    MODELS,
    SEQ,
    VOCAB,
    Spec,
    Unavailable,
    closeness,
    fresh,
    gradients,
    library,
    loss_at,
)

STRATEGIES = ts.REGISTRY.names()
#: Lossless strategies that store every tensor as stock does on a CPU model (offload.cpu is an
#: identity for CPU tensors; quant.L0 is ActNN's "no compression" level).
IDENTITY_ON_CPU = frozenset({"none", "offload.cpu", "quant.L0"})
STEPS = 3

#: The least cosine of a lossy strategy's first gradient with stock's, all parameters
#: together, on every model here (``python -m torchstash_bench.ecosystem`` prints them; the
#: lowest measured on 2026-11-26 in the comments). A model whose largest gradient is one
#: layer's (EfficientNet-B0's stem, fed the image at the codec's width) is judged on it.
MIN_COSINE = {
    "quant.int8": 0.99,  # 0.9997
    "quant": 0.99,  # quant.int8's preset
    "quant.mesa": 0.99,  # 0.9994
    "quant.fp8": 0.99,  # 0.9993
    "quant.int4": 0.95,  # 0.98 (EfficientNet-B0)
    "quant.L1": 0.95,  # int4 on linear and conv inputs only
    "quant.L2": 0.95,  # int4
    "quant.int2": 0.5,  # 0.62 (EfficientNet-B0), 0.80 (ResNet-18), 0.89 (MobileNetV3)
    "dropit.mink": 0.6,  # 0.75 (torchvision ViT-B/16)
    "dropit.random": 0.25,  # 0.35: unbiased, but a tenth of each input kept
    # quant.auto's first step, before its first allocation, stores each kind of tensor at
    # quant.int2's width (0.61 on EfficientNet-B0); L3 to L5 are auto at a budget of 2.
    "quant.auto": 0.5,
    "quant.L3": 0.5,
    "quant.L4": 0.5,
    "quant.L5": 0.5,
    # Reported, not held: one bit per element (EfficientNet-B0 0.00, ResNet-18 0.18).
    "quant.int1": -1.0,
}


#: (model, strategy) whose first gradient is finite but far from stock's, so SGD diverges
#: within the test's steps: held to their first step only, with the measured reason.
DIVERGES = {
    ("timm-efficientnet_b0", "quant.int1"): "one bit at every layer of 16 blocks: the first "
    "gradient's norm is 360x stock's (each op kind alone 2-5x); NaN by the third step",
}


def _spec(name: str) -> Spec:
    spec = MODELS[name]
    try:
        library(spec.library)
    except Unavailable as e:
        pytest.skip(str(e))
    return spec


def _hooks(model: nn.Module) -> int:
    return hook_total(model)


class Stock:
    def __init__(self, grads: dict[str, torch.Tensor], loss: float, raw_bytes: int) -> None:
        self.grads, self.loss, self.raw_bytes = grads, loss, raw_bytes


@cache
def _stock(name: str) -> Stock:
    """Stock's first step (no torchstash), and its saved bytes as the ``none`` identity counts."""
    spec = MODELS[name]
    model = fresh(spec)
    loss = loss_at(spec, model, 0)
    loss.backward()
    grads = gradients(model)
    model.zero_grad(set_to_none=True)
    with ts.apply(model, "none") as handle:
        loss_at(spec, model, 0).backward()
        raw = handle.tally.raw_bytes
    return Stock(grads, loss.item(), raw)


# -- the test ----------------------------------------------------------------------------------


def test_every_lossy_strategy_has_a_tolerance() -> None:
    lossy = {n for n in STRATEGIES if not lossless_of(n)}
    assert lossy <= MIN_COSINE.keys(), sorted(lossy - MIN_COSINE.keys())


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_strategy_on_model(model_name: str, strategy: str) -> None:
    spec = _spec(model_name)
    model = fresh(spec)
    stock = _stock(model_name)
    types = {n: type(m) for n, m in model.named_modules()}
    keys = list(model.state_dict())
    hooks = _hooks(model)
    memsave, why = spec.memsave
    if strategy == "memsave" and memsave == "error":
        with pytest.warns(NothingToRewriteWarning, match="found no module to rewrite"):
            ts.apply(model, strategy).remove()
        assert {n: type(m) for n, m in model.named_modules()} == types
        return

    handle = ts.apply(model, strategy)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(1 if (model_name, strategy) in DIVERGES else STEPS):
        handle.tally.reset()
        loss = loss_at(spec, model, step)
        loss.backward()
        grads = gradients(model)
        assert math.isfinite(loss.item())
        assert grads.keys() == stock.grads.keys()  # every parameter stock trains gets one
        assert all(g.isfinite().all() for g in grads.values()), f"step {step}"
        if step == 0:
            assert loss.item() == stock.loss  # forward is untouched
            _check_bytes(model_name, strategy, handle, stock.raw_bytes, why)
            if lossless_of(strategy):
                assert all(torch.equal(grads[n], g) for n, g in stock.grads.items())
            else:
                whole, median = closeness(stock.grads, grads)
                assert whole >= MIN_COSINE[strategy], (whole, median)
        opt.step()
        opt.zero_grad(set_to_none=True)

    handle.remove()
    assert {n: type(m) for n, m in model.named_modules()} == types
    assert list(model.state_dict()) == keys
    assert _hooks(model) == hooks
    # After remove, a step is stock's on the same weights, bit for bit, and nothing is counted.
    twin = fresh(spec)
    twin.load_state_dict(model.state_dict())
    handle.tally.reset()
    ours, theirs = loss_at(spec, model, STEPS), loss_at(spec, twin, STEPS)
    assert torch.equal(ours, theirs)
    ours.backward()
    theirs.backward()
    assert handle.tally.raw_bytes == 0
    twin_grads = gradients(twin)
    assert all(torch.equal(g, twin_grads[n]) for n, g in gradients(model).items())


def _check_bytes(model_name: str, strategy: str, handle: ts.Handle, stock: int, why: str) -> None:
    """Exactly stock's bytes where the strategy is an identity here, fewer where it reaches."""
    stored = handle.tally.stored_bytes
    compressed = sum(r.compressed for r in handle.tally.rows.values())
    assert stock > 0
    if strategy in IDENTITY_ON_CPU:
        assert (stored, compressed) == (stock, 0)
    elif strategy == "memsave":
        if MODELS[model_name].memsave[0] == "reduces":
            assert stored < stock, why
        else:
            assert stored == stock, why
    else:  # every lossy strategy reaches at least the linear layers' inputs
        assert compressed > 0
        assert stored < stock, (stored, stock)


# -- activation checkpointing (transformers' activation_checkpointing_enable) -------------------

#: lossy strategies, which keep the reentrant checkpoint's attention mask exact (it is a
#: constant an autograd Function saves): a group code of 0 and finfo.min came back non-finite
MASK_QUANTIZED = frozenset(
    {"quant", "quant.L2", "quant.L3", "quant.L4", "quant.L5", "quant.auto"}
    | {f"quant.int{b}" for b in (1, 2, 4, 8)}
)


def _checkpointed_gpt2(reentrant: bool) -> nn.Module:
    _spec("hf-gpt2")  # skips without transformers
    tf = library("transformers")
    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=SEQ, vocab_size=VOCAB, bos_token_id=0,
        eos_token_id=0, attn_implementation="eager" if reentrant else "sdpa",
    )  # fmt: skip
    model = tf.GPT2LMHeadModel(cfg)
    model.train()
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": reentrant}
    )
    return model


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant-eager"])
def test_activation_checkpointing(reentrant: bool, strategy: str) -> None:
    spec = MODELS["hf-gpt2"]
    stock = _checkpointed_gpt2(reentrant)
    loss_at(spec, stock, 0).backward()
    model = _checkpointed_gpt2(reentrant)
    with ts.apply(model, strategy) as h:
        loss = loss_at(spec, model, 0)
        loss.backward()
    if reentrant and strategy in MASK_QUANTIZED:
        declined = sum(r.declined[CONSTANT_REASON] for r in h.tally.rows.values())
        assert declined >= 1, h.tally.rows
    grads, want = gradients(model), gradients(stock)
    assert math.isfinite(loss.item()) and grads.keys() == want.keys()
    assert all(g.isfinite().all() for g in grads.values())
    if lossless_of(strategy):
        assert all(torch.equal(grads[n], g) for n, g in want.items())


def _bf16_step(spec: Spec, strategy: str | None) -> dict[str, torch.Tensor]:
    model = fresh(spec)
    handle = ts.apply(model, strategy) if strategy else None
    with torch.autocast("cpu", torch.bfloat16):
        loss = loss_at(spec, model, 0)
    loss.backward()
    if handle is not None:
        handle.remove()
    return gradients(model)


@pytest.mark.parametrize("strategy", ["quant.int2", "quant.auto", "dropit.mink"])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_bf16_autocast_with_cudas_policy(model_name: str, strategy: str) -> None:
    """Under bf16 autocast with CUDA's policy (softmax, log-softmax and LayerNorm in float32,
    emulated on the CPU: :mod:`torchstash.testing.autocast`), a strategy's first gradients
    are as close to stock's as under the CPU's policy. Under CUDA's policy, BERT's masked-LM
    head (GELU, then LayerNorm on its bf16 output) fell from 0.994 to 0.936 under int2: the
    LayerNorm's float32 copy of its input was taken for a statistic and its output coded at
    2 bits instead of recomputed."""
    from torchstash.testing.autocast import cuda_autocast_policy_on_cpu

    spec = _spec(model_name)
    cpu = closeness(_bf16_step(spec, None), _bf16_step(spec, strategy))[0]
    with cuda_autocast_policy_on_cpu():
        cuda = closeness(_bf16_step(spec, None), _bf16_step(spec, strategy))[0]
    assert cuda >= cpu - 0.02, (cuda, cpu)
