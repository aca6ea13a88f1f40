"""Every registered strategy on the models users bring: Hugging Face transformers (GPT-2, BERT,
ViT, Llama), timm (DeiT, ResNet) and torchvision (ResNet-18), each built tiny from a config
(nothing is downloaded) and skipped with a reason where its library is not installed.

Per (model, strategy): a few SGD steps train (finite loss and gradients); the saved bytes of
the first step are stock's exactly for the strategies that are identities here, and below
stock's for the ones that compress something on that model; a lossless strategy's first
gradients equal stock's bit for bit; ``remove`` gives back the same modules, ``state_dict``
keys and training step (loss and gradients) as a stock model with the same weights.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
import torch
from torch import nn

import torchstash as ts
from torchstash.bench.common import lossless_of
from torchstash.engine import CONSTANT_REASON
from torchstash.errors import ApplyError

STRATEGIES = ts.REGISTRY.names()
#: Lossless strategies that store every tensor as stock does on a CPU model (offload.cpu is an
#: identity for CPU tensors; quant.L0 is ActNN's "no compression" level).
IDENTITY_ON_CPU = frozenset({"none", "offload.cpu", "quant.L0"})
STEPS = 3
VOCAB = 128
SEQ = 16
BATCH = 4
IMAGE = 32
CLASSES = 10

Batch = dict[str, torch.Tensor]


def _library(name: str) -> Any:
    """The library, or a skip naming it: a broken install (torchvision built for another torch
    raises a RuntimeError on import) is a reason to skip, as a missing one is."""
    try:
        return importlib.import_module(name)
    except Exception as e:  # ImportError, or the RuntimeError of a mismatched binary
        pytest.skip(f"{name} is not usable here: {type(e).__name__}: {str(e)[:120]}")


# -- the models --------------------------------------------------------------------------------


def _gpt2() -> nn.Module:
    tf = _library("transformers")
    cfg = tf.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=SEQ, vocab_size=VOCAB, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return tf.GPT2LMHeadModel(cfg)


def _bert() -> nn.Module:
    tf = _library("transformers")
    cfg = tf.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=SEQ,
    )  # fmt: skip
    return tf.BertForMaskedLM(cfg)


def _vit() -> nn.Module:
    tf = _library("transformers")
    cfg = tf.ViTConfig(
        image_size=IMAGE, patch_size=8, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, num_labels=CLASSES,
    )  # fmt: skip
    return tf.ViTForImageClassification(cfg)


def _llama() -> nn.Module:
    tf = _library("transformers")
    cfg = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return tf.LlamaForCausalLM(cfg)


def _timm_deit() -> nn.Module:
    timm = _library("timm")
    return timm.create_model(
        "deit_tiny_patch16_224", pretrained=False, img_size=IMAGE, patch_size=8, depth=2,
        num_classes=CLASSES,
    )  # fmt: skip


def _timm_resnet() -> nn.Module:
    timm = _library("timm")
    return timm.create_model("resnet10t", pretrained=False, num_classes=CLASSES)


def _torchvision_resnet() -> nn.Module:
    models = _library("torchvision.models")
    return models.resnet18(num_classes=CLASSES)


def _tokens(g: torch.Generator) -> Batch:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def _images(g: torch.Generator) -> Batch:
    x = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g)
    return {"pixel_values": x, "labels": torch.randint(0, CLASSES, (BATCH,), generator=g)}


def _hf_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(**batch).loss


def _logits_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["pixel_values"]), batch["labels"])


@dataclass(frozen=True)
class Spec:
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    #: what memsave does here: "reduces", "equal" (rewrites, saves as stock) or "error"
    #: (nothing to rewrite), and why
    memsave: tuple[str, str]


MODELS = {
    "hf-gpt2": Spec(
        _gpt2, _tokens, _hf_loss, ("reduces", "its Dropout(0.1) layers keep 1-bit masks")
    ),
    "hf-bert": Spec(
        _bert, _tokens, _hf_loss, ("reduces", "its Dropout(0.1) layers keep 1-bit masks")
    ),
    "hf-vit": Spec(
        _vit,
        _images,
        _hf_loss,
        ("equal", "dropout 0, LayerNorm and the patch conv train: stock keeps only what is needed"),
    ),
    "hf-llama": Spec(
        _llama,
        _tokens,
        _hf_loss,
        ("error", "LlamaRMSNorm is its own class and SiLU is no ReLU: nothing to rewrite"),
    ),
    "timm-deit": Spec(
        _timm_deit, _images, _logits_loss, ("equal", "dropout 0; LayerNorm and convs train")
    ),
    "timm-resnet": Spec(
        _timm_resnet, _images, _logits_loss, ("reduces", "ReLU masks and max-pool codes")
    ),
    "torchvision-resnet18": Spec(
        _torchvision_resnet, _images, _logits_loss, ("reduces", "ReLU masks and max-pool codes")
    ),
}


# -- helpers -----------------------------------------------------------------------------------


def _fresh(spec: Spec) -> nn.Module:
    torch.manual_seed(0)
    model = spec.build()
    model.train()
    return model


def _batch(spec: Spec, step: int) -> Batch:
    return spec.batch(torch.Generator().manual_seed(step))


def _loss(spec: Spec, model: nn.Module, step: int) -> torch.Tensor:
    batch = _batch(spec, step)
    torch.manual_seed(1000 + step)  # the same dropout draws for stock and the strategy
    return spec.loss(model, batch)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@dataclass(frozen=True)
class Stock:
    grads: dict[str, torch.Tensor]
    loss: float
    raw_bytes: int


@cache
def _stock(name: str) -> Stock:
    """Stock's first step (no torchstash), and its saved bytes as the ``none`` identity counts."""
    spec = MODELS[name]
    model = _fresh(spec)
    loss = _loss(spec, model, 0)
    loss.backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    with ts.apply(model, "none") as handle:
        _loss(spec, model, 0).backward()
        raw = handle.tally.raw_bytes
    return Stock(grads, loss.item(), raw)


# -- the test ----------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_strategy_on_model(model_name: str, strategy: str) -> None:
    spec = MODELS[model_name]
    model = _fresh(spec)
    stock = _stock(model_name)
    types = {n: type(m) for n, m in model.named_modules()}
    keys = list(model.state_dict())
    hooks = _hooks(model)
    memsave, why = spec.memsave
    if strategy == "memsave" and memsave == "error":
        with pytest.raises(ApplyError, match="found no module to rewrite"):
            ts.apply(model, strategy)
        assert {n: type(m) for n, m in model.named_modules()} == types
        return

    handle = ts.apply(model, strategy)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        handle.tally.reset()
        loss = _loss(spec, model, step)
        loss.backward()
        grads = _grads(model)
        assert math.isfinite(loss.item())
        assert grads.keys() == stock.grads.keys()  # every parameter stock trains gets one
        assert all(g.isfinite().all() for g in grads.values()), f"step {step}"
        if step == 0:
            assert loss.item() == stock.loss  # forward is untouched
            _check_bytes(model_name, strategy, handle, stock.raw_bytes, why)
            if lossless_of(strategy):
                assert all(torch.equal(grads[n], g) for n, g in stock.grads.items())
        opt.step()
        opt.zero_grad(set_to_none=True)

    handle.remove()
    assert {n: type(m) for n, m in model.named_modules()} == types
    assert list(model.state_dict()) == keys
    assert _hooks(model) == hooks
    # After remove, a step is stock's on the same weights, bit for bit, and nothing is counted.
    twin = _fresh(spec)
    twin.load_state_dict(model.state_dict())
    handle.tally.reset()
    ours, theirs = _loss(spec, model, STEPS), _loss(spec, twin, STEPS)
    assert torch.equal(ours, theirs)
    ours.backward()
    theirs.backward()
    assert handle.tally.raw_bytes == 0
    twin_grads = _grads(twin)
    assert all(torch.equal(g, twin_grads[n]) for n, g in _grads(model).items())


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
    tf = _library("transformers")
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
    _loss(spec, stock, 0).backward()
    model = _checkpointed_gpt2(reentrant)
    with ts.apply(model, strategy) as h:
        loss = _loss(spec, model, 0)
        loss.backward()
    if reentrant and strategy in MASK_QUANTIZED:
        declined = sum(r.declined[CONSTANT_REASON] for r in h.tally.rows.values())
        assert declined >= 1, h.tally.rows
    grads, want = _grads(model), _grads(stock)
    assert math.isfinite(loss.item()) and grads.keys() == want.keys()
    assert all(g.isfinite().all() for g in grads.values())
    if lossless_of(strategy):
        assert all(torch.equal(grads[n], g) for n, g in want.items())
