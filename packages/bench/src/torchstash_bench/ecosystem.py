"""The models users bring, each strategy on each: saved bytes and how close its gradient is.

Hugging Face transformers (GPT-2, BERT, ViT, Llama), timm (DeiT, ResNet-10t, ConvNeXt-atto,
EfficientNet-B0) and torchvision (ResNet-18, MobileNetV3-small, ViT-B/16), built from their
configs with random weights (nothing is downloaded) at small sizes, each skipped with the
reason where its library is missing. ``tests/ecosystem`` trains every strategy on them;
``python -m torchstash_bench.ecosystem`` prints the table the README quotes:

- **raw / stored MB**: what stock saves for backward in one step and what the strategy
  stores, by the exact accounting of :func:`torchstash.measure` (parameters not counted);
- **cosine**: of the strategy's first gradient with stock's, all parameters together (a
  model whose largest gradient is one layer's, an EfficientNet's stem, is judged mostly on
  that layer), and the median over weight tensors of each one's own cosine.

A model whose classifier starts at zero (torchvision's ViT) gives no gradient below it at the
first step; its head is given small random weights here, so the comparison means something.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchstash.api import apply

from .common import MB, STOCK, error_text, key, rows_table, split_names, strategy_names

VOCAB = 128
SEQ = 16
BATCH = 4
IMAGE = 32
CLASSES = 10

Batch = dict[str, torch.Tensor]


class Unavailable(RuntimeError):
    """A model's library is not installed, or does not load with this torch."""


def library(name: str) -> Any:
    """The library, or :class:`Unavailable` naming it (a torchvision built for another torch
    raises a RuntimeError on import: as unusable as a missing one)."""
    try:
        return importlib.import_module(name)
    except Exception as e:  # ImportError, or the RuntimeError of a mismatched binary
        raise Unavailable(f"{name} is not usable here: {type(e).__name__}: {str(e)[:120]}") from e


# -- the models --------------------------------------------------------------------------------


def _hf(config: str, model: str, **options: Any) -> Callable[[], nn.Module]:
    """A Hugging Face model built from its config class (no weights downloaded)."""

    def build() -> nn.Module:
        tf = library("transformers")
        built: nn.Module = getattr(tf, model)(getattr(tf, config)(**options))
        return built

    build.__name__ = f"hf_{model}"
    return build


_gpt2 = _hf(
    "GPT2Config", "GPT2LMHeadModel", n_layer=2, n_embd=64, n_head=4, n_positions=SEQ,
    vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
)  # fmt: skip
_bert = _hf(
    "BertConfig", "BertForMaskedLM", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
    num_attention_heads=4, intermediate_size=128, max_position_embeddings=SEQ,
)  # fmt: skip
_hf_vit = _hf(
    "ViTConfig", "ViTForImageClassification", image_size=IMAGE, patch_size=8, hidden_size=64,
    num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, num_labels=CLASSES,
)  # fmt: skip
_llama = _hf(
    "LlamaConfig", "LlamaForCausalLM", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0,
)  # fmt: skip


def _timm(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        timm = library("timm")
        return timm.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs)

    build.__name__ = f"timm_{name}"
    return build


def _torchvision(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        models = library("torchvision.models")
        model: nn.Module = getattr(models, name)(num_classes=CLASSES, **kwargs)
        heads = getattr(model, "heads", None)
        if heads is not None:  # ViT's classifier starts at zero: no gradient below it at first
            for m in heads.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=0.02)
        return model

    build.__name__ = f"torchvision_{name}"
    return build


def _tokens(g: torch.Generator) -> Batch:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def _images(g: torch.Generator) -> Batch:
    x = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g)
    return {"pixel_values": x, "labels": torch.randint(0, CLASSES, (BATCH,), generator=g)}


def _hf_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    loss: torch.Tensor = model(**batch).loss
    return loss


def _logits_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["pixel_values"]), batch["labels"])


@dataclass(frozen=True)
class Spec:
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    library: str
    #: what memsave does here: "reduces", "equal" (rewrites, saves as stock) or "error"
    #: (nothing to rewrite), and why
    memsave: tuple[str, str]


def _vision(build: Callable[[], nn.Module], library: str, memsave: tuple[str, str]) -> Spec:
    """An image classifier: random images, cross-entropy on its logits."""
    return Spec(build, _images, _logits_loss, library, memsave)


def _hf_text(build: Callable[[], nn.Module], memsave: tuple[str, str]) -> Spec:
    """A Hugging Face language model: random tokens as its own labels, its own loss."""
    return Spec(build, _tokens, _hf_loss, "transformers", memsave)


#: what memsave does to a model whose only rewritable layers are its dropouts
_DROPOUT_MASKS = ("reduces", "its Dropout(0.1) layers keep 1-bit masks")


MODELS: dict[str, Spec] = {
    "hf-gpt2": _hf_text(_gpt2, _DROPOUT_MASKS),
    "hf-bert": _hf_text(_bert, _DROPOUT_MASKS),
    "hf-vit": Spec(
        _hf_vit, _images, _hf_loss, "transformers",
        ("equal", "dropout 0, LayerNorm and the patch conv train: stock keeps only what is needed"),
    ),
    "hf-llama": _hf_text(
        _llama, ("error", "LlamaRMSNorm is its own class and SiLU is no ReLU: nothing to rewrite")
    ),
    "timm-deit": _vision(
        _timm("deit_tiny_patch16_224", img_size=IMAGE, patch_size=8, depth=2), "timm",
        ("equal", "dropout 0; LayerNorm and convs train"),
    ),
    "timm-resnet10t": _vision(
        _timm("resnet10t"), "timm",
        ("reduces", "ReLU masks and max-pool codes"),
    ),
    "timm-convnext_atto": _vision(
        _timm("convnext_atto"), "timm",
        ("equal", "LayerNorm2d, GELU and depthwise convs that train: nothing stock keeps extra"),
    ),
    "timm-efficientnet_b0": _vision(
        _timm("efficientnet_b0"), "timm",
        ("equal", "BatchNorm and convs that train, SiLU: nothing stock keeps extra"),
    ),
    "torchvision-resnet18": _vision(
        _torchvision("resnet18"), "torchvision",
        ("reduces", "ReLU masks and max-pool codes"),
    ),
    "torchvision-mobilenet_v3_small": _vision(
        _torchvision("mobilenet_v3_small"), "torchvision",
        ("reduces", "the ReLUs of its blocks and of its squeeze-excitation keep 1-bit masks"),
    ),
    "torchvision-vit_b_16": _vision(
        _torchvision("vit_b_16", image_size=IMAGE), "torchvision",
        ("equal", "dropout 0, LayerNorm and the patch conv train: stock keeps only what is needed"),
    ),
}  # fmt: skip


# -- one step ----------------------------------------------------------------------------------


def fresh(spec: Spec) -> nn.Module:
    """The model, built with seed 0, in training mode."""
    torch.manual_seed(0)
    model = spec.build()
    model.train()
    return model


def loss_at(spec: Spec, model: nn.Module, step: int) -> torch.Tensor:
    """The loss on batch ``step`` (the same dropout draws for stock and any strategy)."""
    batch = spec.batch(torch.Generator().manual_seed(step))
    torch.manual_seed(1000 + step)
    return spec.loss(model, batch)


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """In float64, with no floor on the norms (a layer-scaled block's gradients are 1e-9)."""
    a, b = a.flatten().double(), b.flatten().double()
    den = float(a.norm() * b.norm())
    return float(a @ b) / den if den > 0 else (1.0 if torch.equal(a, b) else 0.0)


def closeness(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(cosine of all gradients together, median over weight tensors of each one's cosine)."""
    names = list(ref)
    whole = cosine(
        torch.cat([ref[n].flatten() for n in names]), torch.cat([got[n].flatten() for n in names])
    )
    weights = [cosine(ref[n], got[n]) for n in names if ref[n].dim() >= 2 and ref[n].norm() > 0]
    return whole, statistics.median(weights) if weights else whole


def measure_model(name: str, strategies: Sequence[str]) -> list[dict[str, Any]]:
    """Stock's first step and each strategy's on model ``name``; one row each."""
    spec = MODELS[name]
    model = fresh(spec)
    loss_at(spec, model, 0).backward()
    ref = gradients(model)
    rows: list[dict[str, Any]] = []
    raw = None
    for strategy in ["none", *strategies]:
        row: dict[str, Any] = {"model": name, "strategy": strategy, "error": None}
        try:
            model = fresh(spec)
            with apply(model, strategy) as handle:
                loss_at(spec, model, 0).backward()
                tally = handle.tally
            got = gradients(model)
            whole, median = closeness(ref, got)
            if strategy == "none":
                raw = tally.raw_bytes
            row.update(
                raw_mb=(raw or tally.raw_bytes) / MB,  # a rewriter's own raw count is not stock's
                stored_mb=tally.stored_bytes / MB,
                cosine=whole,
                median_cosine=median,
                finite=all(bool(g.isfinite().all()) for g in got.values()),
            )
        except Exception as e:  # a strategy that refuses the model (memsave) is a row too
            row["error"] = error_text(e)
        rows.append(row if strategy != "none" else {**row, "strategy": STOCK})
    return rows


# -- the command -------------------------------------------------------------------------------


def _table(rows: list[dict[str, Any]]) -> Any:
    columns = [
        ("model", key("model")),
        ("strategy", key("strategy")),
        ("raw MB", key("raw_mb", ".2f")),
        ("stored MB", key("stored_mb", ".2f")),
        ("ratio", lambda r: f"{r['raw_mb'] / r['stored_mb'] if r['stored_mb'] else math.inf:.2f}x"),
        ("cosine", key("cosine", ".4f")),
        ("median cos", key("median_cosine", ".4f")),
    ]
    title = "torchstash on models users bring: one step on CPU, against stock"
    return rows_table(title, columns, rows, failed="error")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchstash_bench.ecosystem", description=__doc__)
    p.add_argument("--models", type=split_names, default=None, help="default: all")
    p.add_argument("--strategies", type=split_names, default=None, help="default: all installed")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default: 1)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the rows as JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from rich.console import Console

    console = Console(highlight=False)
    strategies = strategy_names(args.strategies)
    rows: list[dict[str, Any]] = []
    for name in args.models or list(MODELS):
        try:
            library(MODELS[name].library)
        except Unavailable as e:
            console.print(f"{name}: skipped, {e}")
            continue
        rows += measure_model(name, strategies)
        console.print(f"{name}: done", highlight=False)
    console.print(_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    failed = [r for r in rows if r["error"] and r["strategy"] != "memsave"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
