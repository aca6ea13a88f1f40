"""Convergence benchmark: stock PyTorch against every strategy on models the demo does not use.

Three models, each written here (not the zoo's or the demo's):

* ``gpt-sdpa``: a pre-norm char-level GPT (d=256, 4 layers, 4 heads, GELU MLP 4x, tied
  embedding and head, no biases) whose attention is ``F.scaled_dot_product_attention``;
* ``gpt-manual``: the same GPT with attention written out,
  ``softmax(q @ k.transpose(-2, -1) * scale + causal_mask) @ v``;
* ``cnn``: a small ResNet-like CNN (BatchNorm2d, ReLU, a depthwise conv, squeeze-excitation)
  classifying procedurally drawn noisy 32x32 textures generated here from a seed.

The GPTs read the demo's corpus (this machine's Python standard library, nothing downloaded)
with batch 8 of 128 characters. Every run of a model starts from the same weights and sees
the same batches; only the strategy differs. AdamW, lr 3e-3 (the GPTs: 30 steps of warmup,
then a cosine decay to a tenth; the CNN: a cosine decay to 0, as its BatchNorm statistics lag
a constant rate), 300 steps by default. A second stock run, its initial weights scaled by
1 + 1e-4 noise (``stock+noise``), shows how far "vs stock" moves for no strategy's fault.

Per (model, strategy) it reports the final validation loss and its difference from stock's in
percent, whether that meets the strategy's target (:data:`TARGETS`; lossless strategies must
stay within 0.1%, dropit and quant.int1 are reported only), the worst per-parameter gradient
cosine against stock at step 0 (same weights, same batch) and at stock's trained weights (the
end of its run, on a held-out batch: attention is peaked there, where a coded attention map
once gave ``q``'s and ``k``'s gradients cosines near 0 while step 0 read 0.99), and stock's
saved bytes over the strategy's for the last step.

    python scripts/convergence.py --threads 1 --json conv.json --markdown conv.md
    python scripts/convergence.py --models gpt-manual --strategies none,quant.int8 --steps 50
    python scripts/convergence.py --models gpt-manual,gpt-sdpa --probe-only
    python scripts/convergence.py --schedule constant --steps 200 --strategies quant.int2

``--check`` makes the exit status 1 when a strategy misses its target (or fails where it has
one). One line is printed per finished run, flushed, so a log is never silent for long.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from torch import Tensor, nn

import torchstash
from torchstash.policy import parse_spec
from torchstash_bench.common import (
    cpu_threads,
    default_device,
    error_text,
    fmt,
    jsonable,
    num_threads,
    split_names,
)
from torchstash_bench.demo_task import VOCAB, load_corpus, windows

STOCK = "stock"
#: stock again, its initial weights scaled by ``1 + 1e-4 * noise``: the noise floor of "vs stock"
NOISE = "stock+noise"
NOISE_SCALE = 1e-4
MODELS = ("gpt-sdpa", "gpt-manual", "cnn")
SCHEDULES = ("cosine", "constant")

#: Largest validation loss above stock's, in percent, that a strategy may end at. A strategy
#: without an entry is reported only (dropit.*, quant.int1), except a lossless one, which
#: must stay within :data:`LOSSLESS_PCT` either way (it should be bit-exact).
TARGETS: dict[str, float] = {
    "quant": 1.0,  # bits=8 by default
    "quant.int8": 1.0,
    "quant.mesa": 1.0,
    "quant.int4": 2.0,
    "quant.fp8": 2.0,
    "quant.L1": 2.0,
    "quant.L2": 2.0,
    "quant.int2": 3.0,
    "quant.auto": 3.0,
    "quant.L3": 3.0,
    "quant.L4": 3.0,
    "quant.L5": 3.0,
}
LOSSLESS_PCT = 0.1
#: A parameter whose stock gradient norm is at most this fraction of the whole gradient's is
#: left out of the worst per-parameter cosine (its gradient is zero up to rounding).
ZERO_GRAD = 1e-4


# -- sizes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """Sizes of the models, data and schedule (the defaults are the benchmark's)."""

    dim: int = 256
    layers: int = 4
    heads: int = 4
    ctx: int = 128
    batch: int = 8
    lr: float = 3e-3
    #: GPTs: linear warmup over this many steps, then a cosine decay to ``min_lr`` times the
    #: rate. With the rate constant, stock's own final loss moved by +3.9% when its initial
    #: weights were scaled by 1 + 1e-4 noise: the run ended wherever its last loss spike left
    #: it, and no strategy could be judged within 1-2%. Warmup and decay (nanoGPT's schedule)
    #: brought that to -0.2% and +0.4%.
    warmup: int = 30
    min_lr: float = 0.1
    #: ``"cosine"`` (the above, and the CNN's decay to 0) or ``"constant"``: every model at
    #: its rate from the first step to the last, no warmup, no decay, as many users train. The
    #: schedule hides errors that a constant rate shows: quant.int2 with 4-bit LayerNorm
    #: inputs ended -0.24% from stock on gpt-manual under the cosine, +2.9% to +3.3% (three
    #: seeds, 200 steps) at a constant rate.
    schedule: str = "cosine"
    weight_decay: float = 0.01
    clip: float = 1.0  # gradient-norm clipping; 0 turns it off
    corpus_bytes: int = 3 << 20
    val_fraction: float = 0.1
    val_batches: int = 16
    cnn_widths: tuple[int, ...] = (32, 64, 128)
    cnn_batch: int = 32
    cnn_lr: float = 3e-3  # decayed to 0 by a cosine: with a constant rate BatchNorm's
    # running statistics lag the moving weights and eval-mode loss is far above train-mode's
    image: int = 32
    classes: int = 8
    train_images: int = 4096
    val_images: int = 1024
    curve_every: int = 10  # the loss curve is the mean of this many steps

    @classmethod
    def quick(cls) -> Config:
        """Tiny models and data, for smoke tests (seconds)."""
        return cls(
            dim=32,
            layers=1,
            heads=2,
            ctx=32,
            batch=4,
            corpus_bytes=64 << 10,
            val_batches=2,
            cnn_widths=(8, 16, 16),
            cnn_batch=8,
            train_images=128,
            val_images=32,
            curve_every=2,
        )


# -- the GPTs -------------------------------------------------------------------------------


class Attention(nn.Module):
    """Causal multi-head self-attention, by SDPA or written out with an additive mask."""

    def __init__(self, dim: int, heads: int, ctx: int, sdpa: bool) -> None:
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        mask = torch.full((ctx, ctx), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        h = self.heads

        def split(t: Tensor) -> Tensor:
            return t.view(b, n, h, c // h).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scale = 1.0 / math.sqrt(c // h)
            att = q @ k.transpose(-2, -1) * scale + self.mask[:n, :n]
            y = torch.softmax(att, dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, n, c))


class PreNormBlock(nn.Module):
    def __init__(self, dim: int, heads: int, ctx: int, sdpa: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, ctx, sdpa)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TiedGPT(nn.Module):
    """Token and learned position embeddings, pre-norm blocks, a final LayerNorm and a head
    that shares the token embedding's weight."""

    def __init__(self, vocab: int, ctx: int, dim: int, layers: int, heads: int, sdpa: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(ctx, dim))
        self.blocks = nn.ModuleList(PreNormBlock(dim, heads, ctx, sdpa) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.apply(self._init)
        nn.init.normal_(self.position, std=0.02)
        for blk in self.blocks:  # residual projections scaled down with depth (GPT-2)
            for lin in (blk.attn.out, blk.down):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * layers))
        self.head.weight = self.embed.weight

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.embed(idx) + self.position[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


# -- the CNN --------------------------------------------------------------------------------


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, reduction: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(channels, max(channels // reduction, 4))
        self.fc2 = nn.Linear(max(channels // reduction, 4), channels)

    def forward(self, x: Tensor) -> Tensor:
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(x.mean(dim=(2, 3))))))
        return x * s[:, :, None, None]


class SEBlock(nn.Module):
    """conv3x3-BN-ReLU, depthwise 3x3-BN-ReLU, pointwise 1x1-BN, SE, then the residual."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.depthwise = nn.Conv2d(cout, cout, 3, 1, 1, groups=cout, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.pointwise = nn.Conv2d(cout, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.se = SqueezeExcite(cout)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: Tensor) -> Tensor:
        y = self.relu(self.bn1(self.conv(x)))
        y = self.relu(self.bn2(self.depthwise(y)))
        y = self.se(self.bn3(self.pointwise(y)))
        return self.relu(y + self.shortcut(x))


class SENet(nn.Module):
    def __init__(self, widths: Sequence[int], classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        )
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks.append(SEBlock(cin, w, 1 if i == 0 else 2))
            cin = w
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.blocks(self.stem(x)).mean(dim=(2, 3)))


PATTERNS = (
    "horizontal stripes",
    "vertical stripes",
    "diagonal stripes",
    "anti-diagonal stripes",
    "checkerboard",
    "rings",
    "dot grid",
    "blob",
)


def textures(n: int, size: int, classes: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """``n`` noisy RGB images of procedurally drawn patterns (class = pattern), and labels.

    Each image has a random frequency, phase, centre, colour, contrast and offset, plus
    Gaussian noise; low-contrast images are hard, so the task is learnable but not solved in
    a few hundred steps."""
    if not 2 <= classes <= len(PATTERNS):
        raise ValueError(f"classes must be in [2, {len(PATTERNS)}], got {classes}")
    labels = torch.randint(0, classes, (n,), generator=g)

    def u(lo: float, hi: float) -> Tensor:
        return (lo + (hi - lo) * torch.rand(n, generator=g))[:, None, None]

    yy, xx = torch.meshgrid(torch.arange(float(size)), torch.arange(float(size)), indexing="ij")
    freq, p1, p2 = u(0.35, 1.1), u(0, 2 * math.pi), u(0, 2 * math.pi)
    jitter = u(-0.2, 0.2)
    cy, cx = u(4, size - 4), u(4, size - 4)
    r = ((yy - cy) ** 2 + (xx - cx) ** 2).sqrt()

    def stripes(theta: float) -> Tensor:
        t = theta + jitter
        return torch.cos(freq * (xx * torch.cos(t) + yy * torch.sin(t)) + p1)

    drawn = [
        stripes(math.pi / 2),
        stripes(0.0),
        stripes(math.pi / 4),
        stripes(3 * math.pi / 4),
        torch.sign(torch.cos(freq * xx + p1) * torch.cos(freq * yy + p2)),
        torch.cos(freq * r + p1),
        (torch.cos(freq * xx + p1) + torch.cos(freq * yy + p2)) / 2,
        2 * torch.exp(-(r**2) / (2 * u(2.5, 7.0) ** 2)) - 1,
    ]
    pattern = torch.stack(drawn[:classes])[labels, torch.arange(n)]  # (n, size, size)
    colour = F.normalize(torch.randn(n, 3, generator=g), dim=1)[:, :, None, None]
    contrast = u(0.3, 1.0)[:, :, :, None]
    offset = 0.3 * torch.randn(n, 3, 1, 1, generator=g)
    noise = 0.8 * torch.randn(n, 3, size, size, generator=g)
    return contrast * colour * pattern[:, None] + offset + noise, labels


# -- tasks ----------------------------------------------------------------------------------


@dataclass
class Task:
    """A model and its data: the same weights and batches for every run."""

    name: str
    describe: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], tuple[Tensor, Tensor]]  # training step -> inputs, targets
    val: list[tuple[Tensor, Tensor]]
    lr: float
    device: torch.device
    classify: bool  # report validation accuracy too
    cosine: bool = False  # cosine decay of the learning rate over the run (else constant)
    warmup: int = 0  # steps of linear warmup first
    floor: float = 0.0  # the decay's end, a fraction of the rate

    def lr_factor(self, step: int, steps: int) -> float:
        """The learning rate at ``step`` as a fraction of :attr:`lr`."""
        warm = min(1.0, (step + 1) / self.warmup) if self.warmup else 1.0
        if not self.cosine:
            return warm
        decay = 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))
        return warm * (self.floor + (1 - self.floor) * decay)

    def loss(self, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        out = model(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def gpt_task(name: str, cfg: Config, steps: int, seed: int, device: torch.device) -> Task:
    corpus = load_corpus(cfg.corpus_bytes, cfg.val_fraction)
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(corpus.train) - cfg.ctx - 1, (steps, cfg.batch), generator=g)
    n_val = cfg.val_batches * cfg.batch
    top = max(len(corpus.val) - cfg.ctx - 2, 0)
    val_starts = torch.linspace(0, top, n_val).long().view(cfg.val_batches, cfg.batch)
    sdpa = name == "gpt-sdpa"

    def build() -> nn.Module:
        return TiedGPT(VOCAB, cfg.ctx, cfg.dim, cfg.layers, cfg.heads, sdpa)

    def batch(i: int) -> tuple[Tensor, Tensor]:
        x, y = windows(corpus.train, starts[i], cfg.ctx)
        return x.to(device), y.to(device)

    val = [windows(corpus.val, row, cfg.ctx) for row in val_starts]
    attention = "F.scaled_dot_product_attention" if sdpa else "manual softmax(q k^T) v"
    return Task(
        name,
        f"pre-norm tied GPT, d={cfg.dim}, {cfg.layers} layers, {cfg.heads} heads, {attention}; "
        f"batch {cfg.batch} x {cfg.ctx} chars of {corpus.nbytes / 2**20:.1f} MB stdlib source",
        build,
        batch,
        [(x.to(device), y.to(device)) for x, y in val],
        cfg.lr,
        device,
        classify=False,
        cosine=cfg.schedule == "cosine",
        warmup=cfg.warmup if cfg.schedule == "cosine" else 0,
        floor=cfg.min_lr,
    )


def cnn_task(cfg: Config, steps: int, seed: int, device: torch.device) -> Task:
    g = torch.Generator().manual_seed(seed + 1000)
    x_train, y_train = textures(cfg.train_images, cfg.image, cfg.classes, g)
    x_val, y_val = textures(cfg.val_images, cfg.image, cfg.classes, g)
    epochs = math.ceil(steps * cfg.cnn_batch / cfg.train_images)
    order = torch.cat([torch.randperm(cfg.train_images, generator=g) for _ in range(epochs)])
    order = order[: steps * cfg.cnn_batch].view(steps, cfg.cnn_batch)

    def build() -> nn.Module:
        return SENet(cfg.cnn_widths, cfg.classes)

    def batch(i: int) -> tuple[Tensor, Tensor]:
        return x_train[order[i]].to(device), y_train[order[i]].to(device)

    vb = cfg.cnn_batch * 4
    val = [
        (x_val[i : i + vb].to(device), y_val[i : i + vb].to(device))
        for i in range(0, cfg.val_images, vb)
    ]
    return Task(
        "cnn",
        f"SE-ResNet widths {cfg.cnn_widths} (BatchNorm, depthwise conv, SE) on "
        f"{cfg.train_images} synthetic {cfg.image}x{cfg.image} textures, {cfg.classes} classes, "
        f"batch {cfg.cnn_batch}",
        build,
        batch,
        val,
        cfg.cnn_lr,
        device,
        classify=True,
        cosine=cfg.schedule == "cosine",
    )


def make_task(name: str, cfg: Config, steps: int, seed: int, device: torch.device) -> Task:
    if name in ("gpt-sdpa", "gpt-manual"):
        return gpt_task(name, cfg, steps, seed, device)
    if name == "cnn":
        return cnn_task(cfg, steps, seed, device)
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


# -- one run --------------------------------------------------------------------------------


@dataclass
class Run:
    model: str
    strategy: str
    lossless: bool | None = None
    target_pct: float | None = None
    losses: list[float] = field(default_factory=list)
    curve_every: int = 10
    val_loss: float | None = None
    val_acc: float | None = None
    rel_pct: float | None = None
    met: bool | None = None
    worst_cos: float | None = None
    worst_cos_param: str | None = None
    whole_cos: float | None = None  # of the whole gradient
    cos_skipped: list[str] = field(default_factory=list)  # stock gradient zero up to rounding
    #: the same at stock's trained weights (its last step's), on a held-out batch
    trained_worst_cos: float | None = None
    trained_worst_param: str | None = None
    trained_whole_cos: float | None = None
    raw_bytes: int | None = None  # what stock saves in one step
    stored_bytes: int | None = None  # what this run kept for the same step
    host_bytes: int | None = None
    step_ms: float | None = None
    wall_s: float = 0.0
    error: str | None = None

    @property
    def curve(self) -> list[float]:
        k = self.curve_every
        return [statistics.fmean(self.losses[i : i + k]) for i in range(0, len(self.losses), k)]

    @property
    def rise(self) -> float | None:
        """The most the ``curve_every``-step mean train loss climbed above its lowest value so
        far: how far the loss went back up during training."""
        curve = self.curve
        if len(curve) < 2:
            return None
        low, worst = curve[0], 0.0
        for v in curve[1:]:
            worst = max(worst, v - low)
            low = min(low, v)
        return worst

    @property
    def ratio(self) -> float | None:
        if self.raw_bytes is None or self.stored_bytes is None:
            return None
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else math.inf

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["losses"]
        d.update(curve=self.curve, rise=self.rise, ratio=self.ratio)
        return d


def strategy_info() -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in torchstash.strategies()}


def target_of(spec: str, lossless: bool | None) -> float | None:
    """The largest allowed increase of the validation loss over stock's, in percent."""
    name, options = parse_spec(spec)
    if lossless:
        return LOSSLESS_PCT
    if spec in TARGETS:
        return TARGETS[spec]
    return None if options else TARGETS.get(name)


def met_target(run: Run) -> bool | None:
    """None where the run has no target; a failed run misses its target."""
    if run.target_pct is None:
        return None
    if run.rel_pct is None:
        return False
    if run.lossless:
        return abs(run.rel_pct) <= run.target_pct
    return run.rel_pct <= run.target_pct


@torch.no_grad()
def evaluate(task: Task, model: nn.Module) -> tuple[float, float | None]:
    """Mean validation loss (weighted by examples) and, for a classifier, accuracy."""
    model.eval()
    total = correct = 0.0
    count = 0
    for x, y in task.val:
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum")
        total += loss.item()
        count += y.numel()
        if task.classify:
            correct += (out.argmax(-1) == y).sum().item()
    model.train()
    return total / count, (correct / count if task.classify else None)


def stock_bytes(task: Task, model: nn.Module) -> int:
    """What stock PyTorch saves for one step, counted by ``none`` (the identity) on a copy."""
    twin = copy.deepcopy(model)
    with torchstash.apply(twin, "none") as h:
        x, y = task.batch(0)
        task.loss(twin, x, y).backward()
        return h.tally.raw_bytes


@dataclass
class Cosines:
    """Gradient cosines against stock at step 0."""

    worst: float  # the lowest over the parameters compared
    worst_param: str | None
    whole: float  # of the whole gradient, all parameters as one vector
    skipped: list[str]  # parameters whose stock gradient is zero up to rounding


def grad_cosines(model: nn.Module, stock: dict[str, Tensor]) -> Cosines:
    """Cosines between this model's gradient and stock's, per parameter (a missing gradient
    counts as cosine 0) and of the whole gradient.

    A parameter whose stock gradient is zero up to float rounding (norm at most
    :data:`ZERO_GRAD` of the whole gradient's) is left out: its cosine compares rounding
    noise. Such parameters exist: at initialization the loss does not depend on the scale
    of a BatchNorm followed by ReLU and a bias-free conv into another BatchNorm."""
    grads = {n: p.grad for n, p in model.named_parameters()}
    ref_all = torch.cat([r.double().flatten() for r in stock.values()])
    own_all = torch.cat(
        [
            (grads[n] if grads.get(n) is not None else torch.zeros_like(r)).double().flatten()
            for n, r in stock.items()
        ]
    )
    whole = float(own_all @ ref_all / (own_all.norm() * ref_all.norm()).clamp_min(1e-300))
    floor = ZERO_GRAD * float(ref_all.norm())
    worst, where, skipped = 1.0, None, []
    for name, ref in stock.items():
        ref64 = ref.double().flatten()
        ref_norm = float(ref64.norm())
        if ref_norm <= floor:
            skipped.append(name)
            continue
        g = grads.get(name)
        if g is None:
            cos = 0.0
        else:
            g64 = g.double().flatten()
            denom = ref_norm * float(g64.norm())
            cos = float(g64 @ ref64) / denom if denom > 0 else 0.0
        if where is None or cos < worst:
            worst, where = cos, name
    return Cosines(worst, where, whole, skipped)


@dataclass
class Trained:
    """Stock's weights at the end of its run, and its gradient there on a held-out batch."""

    state: dict[str, Tensor]
    grads: dict[str, Tensor]


def gradients(task: Task, model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    model.zero_grad(set_to_none=True)
    task.loss(model, x, y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


#: Passes a strategy makes over the probe batch before its gradient there is taken: its
#: running estimates and allocations settle as they would have in training (``quant.auto``
#: re-allocates after 20 steps; on its first step it codes everything at the budget's width).
SETTLE_PASSES = 24


def trained_cosines(task: Task, strategy: str, trained: Trained, seed: int) -> Cosines:
    """The strategy's gradient against stock's at stock's trained weights (same batch)."""
    torch.manual_seed(seed)
    model = task.build().to(task.device)
    model.load_state_dict(trained.state)
    spec, options = parse_spec(strategy)
    x, y = task.val[0]
    with torchstash.apply(model, spec, **options):
        for _ in range(SETTLE_PASSES):
            gradients(task, model, x, y)
        gradients(task, model, x, y)
    model.load_state_dict(trained.state)  # BatchNorm's running statistics moved
    return grad_cosines(model, trained.grads)


def train(
    task: Task,
    strategy: str | None,
    steps: int,
    seed: int,
    cfg: Config,
    stock: Run | None = None,
    stock_grads: dict[str, Tensor] | None = None,
    trained: Trained | None = None,
    perturb: float = 0.0,
) -> tuple[Run, dict[str, Tensor], Trained | None]:
    """Train a fresh model (stock when ``strategy`` is None); returns the run and, for stock,
    its step-0 gradients and :class:`Trained`. An exception ends the run with ``error`` set.
    ``perturb``: stock with its initial weights scaled by ``1 + perturb * noise`` (the
    :data:`NOISE` run: how far a run moves for a change that is no strategy's fault)."""
    info = strategy_info()
    name = NOISE if perturb else (strategy or STOCK)
    lossless = True if strategy is None else info.get(parse_spec(strategy)[0], {}).get("lossless")
    run = Run(task.name, name)
    run.curve_every = cfg.curve_every
    if strategy is not None:
        run.lossless = None if lossless is None else bool(lossless)
        run.target_pct = target_of(strategy, run.lossless)
    grads0: dict[str, Tensor] = {}
    t_start = time.perf_counter()
    handle = None
    try:
        torch.manual_seed(seed)
        model = task.build().to(task.device)
        if perturb:
            g = torch.Generator().manual_seed(seed + 7)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1 + perturb * torch.randn(p.shape, generator=g).to(p.device))
        if strategy is None:
            run.raw_bytes = stock_bytes(task, model)
        else:
            spec, options = parse_spec(strategy)
            handle = torchstash.apply(model, spec, **options)
        opt = torch.optim.AdamW(model.parameters(), lr=task.lr, weight_decay=cfg.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: task.lr_factor(i, steps))
        torch.manual_seed(seed + 1)  # the same RNG stream for every run's training
        times = []
        for i in range(steps):
            x, y = task.batch(i)
            if handle is not None and i == steps - 1:
                handle.tally.reset()  # count exactly one step: the last
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = task.loss(model, x, y)
            loss.backward()
            if i == 0:
                if strategy is None:
                    grads0 = {
                        n: p.grad.detach().clone()
                        for n, p in model.named_parameters()
                        if p.grad is not None
                    }
                elif stock_grads is not None:
                    cos = grad_cosines(model, stock_grads)
                    run.worst_cos, run.worst_cos_param = cos.worst, cos.worst_param
                    run.whole_cos, run.cos_skipped = cos.whole, cos.skipped
            if cfg.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            opt.step()
            sched.step()
            run.losses.append(loss.item())
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
            times.append(time.perf_counter() - t0)
            if not math.isfinite(run.losses[-1]):
                raise FloatingPointError(f"loss is {run.losses[-1]} at step {i}")
        if handle is not None:
            rows = list(handle.tally.rows.values())
            run.stored_bytes = handle.tally.stored_bytes
            run.host_bytes = sum(r.host_bytes for r in rows)
            run.raw_bytes = stock.raw_bytes if stock is not None else handle.tally.raw_bytes
        else:
            run.stored_bytes = run.raw_bytes
            run.host_bytes = 0
        run.val_loss, run.val_acc = evaluate(task, model)
        run.step_ms = statistics.median(times[1:] or times) * 1e3
        if strategy is None and not perturb:
            x, y = task.val[0]
            model.train()
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            trained = Trained(state, gradients(task, model, x, y))
        elif trained is not None:
            if handle is not None:
                handle.remove()
                handle = None
            cos = trained_cosines(task, strategy, trained, seed)
            run.trained_worst_cos, run.trained_worst_param = cos.worst, cos.worst_param
            run.trained_whole_cos = cos.whole
    except Exception as e:  # one strategy's failure must not stop the others
        run.error = error_text(e)
    finally:
        if handle is not None:
            handle.remove()
    run.wall_s = time.perf_counter() - t_start
    if stock is not None and run.val_loss is not None and stock.val_loss:
        run.rel_pct = 100 * (run.val_loss - stock.val_loss) / stock.val_loss
    run.met = met_target(run)
    return run, grads0, trained


# -- all runs -------------------------------------------------------------------------------


def default_strategies(include_presets: bool = False) -> list[str]:
    """Every registered strategy; presets (``quant`` and its ActNN levels ``quant.L0``-``L5``,
    which repeat other strategies' numerics) only when asked for."""
    return [s["name"] for s in torchstash.strategies() if include_presets or not s["preset"]]


def progress_line(run: Run) -> str:
    if run.strategy == STOCK:
        what = f"val {fmt(run.val_loss, '.4f')}"
        if run.val_acc is not None:
            what += f", acc {100 * run.val_acc:.1f}%"
    else:
        target = "report only" if run.target_pct is None else f"target {run.target_pct:g}%"
        verdict = {True: "met", False: "MISSED", None: ""}[run.met]
        what = (
            f"val {fmt(run.val_loss, '.4f')} ({fmt(run.rel_pct, '+.2f', '%')}; {target}"
            f"{': ' + verdict if verdict else ''}), worst grad cos {fmt(run.worst_cos, '.4f')} "
            f"({run.worst_cos_param}), whole {fmt(run.whole_cos, '.4f')}; trained: worst "
            f"{fmt(run.trained_worst_cos, '.4f')} ({run.trained_worst_param}), whole "
            f"{fmt(run.trained_whole_cos, '.4f')}; ratio {fmt(run.ratio, '.2f', 'x')}"
        )
    if run.error:
        what = f"FAILED: {run.error}"
    return f"[{run.model}] {run.strategy}: {what}; {run.wall_s:.1f} s"


def probe(task: Task, strategy: str, seed: int, grads0: dict[str, Tensor], trained: Trained) -> Run:
    """A strategy's gradient cosines only, at step 0 and at stock's trained weights: no
    training of its own (``--probe-only``)."""
    run = Run(task.name, strategy)
    t0 = time.perf_counter()
    try:
        torch.manual_seed(seed)
        model = task.build().to(task.device)
        spec, options = parse_spec(strategy)
        x, y = task.batch(0)
        with torchstash.apply(model, spec, **options):
            gradients(task, model, x, y)
        cos = grad_cosines(model, grads0)
        run.worst_cos, run.worst_cos_param, run.whole_cos = cos.worst, cos.worst_param, cos.whole
        cos = trained_cosines(task, strategy, trained, seed)
        run.trained_worst_cos, run.trained_worst_param = cos.worst, cos.worst_param
        run.trained_whole_cos = cos.whole
    except Exception as e:
        run.error = error_text(e)
    run.wall_s = time.perf_counter() - t0
    return run


def run_model(
    task: Task,
    strategies: Sequence[str],
    steps: int,
    seed: int,
    cfg: Config,
    probe_only: bool = False,
) -> list[Run]:
    stock, grads, trained = train(task, None, steps, seed, cfg)
    print(progress_line(stock), flush=True)
    runs = [stock]
    if not probe_only:
        noise, _, _ = train(task, None, steps, seed, cfg, stock, perturb=NOISE_SCALE)
        print(progress_line(noise), flush=True)
        runs.append(noise)
    for s in strategies:
        if probe_only and trained is not None:
            run = probe(task, s, seed, grads, trained)
        else:
            run, _, _ = train(task, s, steps, seed, cfg, stock, grads, trained)
        print(progress_line(run), flush=True)
        runs.append(run)
    return runs


def _met_text(run: Run) -> str:
    if run.strategy == STOCK:
        return ""
    if run.error and run.target_pct is None:
        return "failed"
    return {True: "yes", False: "NO", None: "report"}[run.met]


def _target_text(run: Run) -> str:
    if run.strategy == STOCK:
        return ""
    if run.target_pct is None:
        return "-"
    return f"±{run.target_pct:g}%" if run.lossless else f"≤{run.target_pct:g}%"


COLUMNS = (
    "model",
    "strategy",
    "val loss",
    "vs stock",
    "target",
    "met",
    "val acc",
    "worst grad cos",
    "whole cos",
    "trained worst",
    "trained whole",
    "ratio",
    "rise",
    "step ms",
)


def rows(runs: Sequence[Run]) -> list[list[str]]:
    out = []
    for r in runs:
        out.append(
            [
                r.model,
                r.strategy,
                fmt(r.val_loss, ".4f"),
                "" if r.strategy == STOCK else fmt(r.rel_pct, "+.2f", "%"),
                _target_text(r),
                _met_text(r),
                "" if r.val_acc is None else f"{100 * r.val_acc:.1f}%",
                "" if r.strategy == STOCK else fmt(r.worst_cos, ".4f"),
                "" if r.strategy == STOCK else fmt(r.whole_cos, ".4f"),
                "" if r.strategy == STOCK else fmt(r.trained_worst_cos, ".4f"),
                "" if r.strategy == STOCK else fmt(r.trained_whole_cos, ".4f"),
                fmt(r.ratio, ".2f", "x"),
                fmt(r.rise, ".3f"),
                fmt(r.step_ms, ".0f"),
            ]
        )
    return out


def table(runs: Sequence[Run], title: str) -> Table:
    t = Table(title=title)
    for c in COLUMNS:
        t.add_column(c, justify="left" if c in ("model", "strategy") else "right", no_wrap=True)
    for r, row in zip(runs, rows(runs)):
        style = "red" if r.met is False else None
        t.add_row(*(escape(c) for c in row), style=style)
    return t


def markdown(runs: Sequence[Run], header: str) -> str:
    lines = [header, "", "| " + " | ".join(COLUMNS) + " |"]
    lines.append("|" + "|".join("---" if c in ("model", "strategy") else "--:" for c in COLUMNS))
    lines[-1] += "|"
    for row in rows(runs):
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
    failed = [r for r in runs if r.error]
    if failed:
        lines.append("")
        lines += [f"- {r.model} / {r.strategy} failed: {r.error}" for r in failed]
    return "\n".join(lines) + "\n"


def _schedule_text(cfg: Config) -> str:
    if cfg.schedule == "constant":
        return f"GPTs: lr {cfg.lr:g}; CNN: {cfg.cnn_lr:g}; both constant, no warmup"
    return (
        f"GPTs: lr {cfg.lr:g}, {cfg.warmup} warmup steps, cosine decay to {cfg.min_lr:g}x; "
        f"CNN: {cfg.cnn_lr:g} with cosine decay"
    )


def legend(steps: int, cfg: Config) -> str:
    return (
        f"{steps} steps, AdamW ({_schedule_text(cfg)}), same weights and batches per "
        f"model. {NOISE} = stock with its initial weights scaled by 1 + {NOISE_SCALE:g} noise "
        "(the noise floor of vs stock). vs stock = final validation loss relative to stock's; "
        "target = the most it may "
        f"rise (lossless: within ±{LOSSLESS_PCT:g}% either way; '-' = reported only); worst grad "
        "cos = lowest per-parameter gradient cosine against stock at step 0 (same batch; "
        f"parameters whose stock gradient is zero up to rounding, norm <= {ZERO_GRAD:g} of the "
        "whole gradient's, left out); whole cos = the whole gradient's cosine; trained worst "
        "and trained whole = the same at stock's weights after its last step, on a held-out "
        f"batch (after {SETTLE_PASSES} passes over it, so running estimates and allocations "
        "settle); ratio = stock's saved bytes / the strategy's for one step; rise = most the "
        f"{cfg.curve_every}-step mean train loss climbed back above its lowest so far."
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models",
        type=split_names,
        default=list(MODELS),
        help=f"comma-separated, from {', '.join(MODELS)} (default: all)",
    )
    p.add_argument(
        "--strategies",
        type=split_names,
        default=None,
        help="comma-separated strategies, each with options as name:key=value;key=value; 'all' "
        "adds the presets (quant, quant.L0-L5) (default: every registered strategy but presets)",
    )
    p.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: cores-1, <=4)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    p.add_argument("--json", type=Path, default=None, help="write every run here")
    p.add_argument("--markdown", type=Path, default=None, help="write the table here")
    p.add_argument("--quick", action="store_true", help="tiny models and data (smoke test)")
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="cosine",
        help="learning rate: cosine (warmup then decay; the default) or constant (no warmup, "
        "no decay, as many users train)",
    )
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    p.add_argument(
        "--probe-only",
        action="store_true",
        help="train stock only; for each strategy just its gradient cosines (step 0 and at "
        "stock's trained weights): minutes, not an hour",
    )
    return p


def main(argv: Sequence[str] | None = None, console: Console | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    known = strategy_info()
    if args.strategies is None:
        strategies = default_strategies()
    elif args.strategies == ["all"]:
        strategies = default_strategies(include_presets=True)
    else:
        strategies = list(dict.fromkeys(args.strategies))
        missing = [s for s in strategies if parse_spec(s)[0] not in known]
        if missing:
            raise SystemExit(f"not registered: {', '.join(missing)}; see torchstash.strategies()")
    cfg = replace(Config.quick() if args.quick else Config(), schedule=args.schedule)
    device = torch.device(args.device) if args.device else default_device()
    threads = cpu_threads(args.threads) if device.type == "cpu" else torch.get_num_threads()
    with num_threads(threads):
        return _main(args, strategies, cfg, device, threads, console)


def _main(
    args: argparse.Namespace,
    strategies: list[str],
    cfg: Config,
    device: torch.device,
    threads: int,
    console: Console | None,
) -> int:
    # a log file gets the whole table, not one cut to 80 columns
    console = console or Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    t0 = time.perf_counter()
    print(
        f"convergence: {', '.join(args.models)} x stock + {', '.join(strategies)}; "
        f"{args.steps} steps on {device} ({threads} threads), torch {torch.__version__}",
        flush=True,
    )
    runs: list[Run] = []
    described: dict[str, str] = {}
    for m in args.models:
        task = make_task(m, cfg, args.steps, args.seed, device)
        described[m] = task.describe
        runs += run_model(task, strategies, args.steps, args.seed, cfg, args.probe_only)
    wall = time.perf_counter() - t0
    title = f"convergence: {args.steps} steps on {device}, {threads} threads"
    console.print(table(runs, title))
    console.print(escape(legend(args.steps, cfg)))
    for r in runs:
        if r.error:
            console.print(f"  {escape(r.model)} / {escape(r.strategy)}: {escape(r.error)}")
    missed = [r for r in runs if r.met is False]
    if args.json:
        data = {
            "torch": torch.__version__,
            "device": str(device),
            "threads": threads,
            "steps": args.steps,
            "seed": args.seed,
            "config": asdict(cfg),
            "models": described,
            "targets": TARGETS,
            "lossless_pct": LOSSLESS_PCT,
            "wall_s": wall,
            "missed": [f"{r.model}/{r.strategy}" for r in missed],
            "runs": [r.to_dict() for r in runs],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(jsonable(data), indent=2) + "\n")
    if args.markdown:
        header = "\n".join(
            [*(f"- {k}: {v}" for k, v in described.items()), "", legend(args.steps, cfg)]
        )
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(runs, header))
    verdict = (
        f"missed: {', '.join(f'{r.model}/{r.strategy}' for r in missed)}" if missed else "all met"
    )
    if args.probe_only:
        verdict = "not judged (--probe-only trains stock alone)"
    print(f"done in {wall:.0f} s; targets {verdict}", flush=True)
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
