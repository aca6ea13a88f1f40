"""The convergence benchmark's models, data and schedules (``scripts/convergence.py``): a
pre-norm GPT with SDPA or written-out attention on the demo's corpus, and a small ResNet-like
CNN with a depthwise conv and squeeze-excitation on procedurally drawn textures. None of them
is the zoo's or the demo's, so a strategy is judged on models it was not tuned on."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .demo_task import VOCAB, load_corpus, windows

MODELS = ("gpt-sdpa", "gpt-manual", "cnn")


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
