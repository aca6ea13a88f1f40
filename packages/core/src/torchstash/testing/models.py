"""Small models in the shapes users train: a GPT-style stack, a ViT-style stack, a ResNet.

They are the bench's zoo (``torchstash-bench``) and the tests' subjects, here so that tests
and tools alike may import them. Attention is written out (``q @ k.T``,
``softmax``) as many user models do, so the op tracker is exercised; ``sdpa=True`` uses
``F.scaled_dot_product_attention`` instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, causal: bool, sdpa: bool = False) -> None:
        super().__init__()
        self.heads, self.causal, self.sdpa = heads, causal, sdpa
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            if self.causal:
                mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
                att = att.masked_fill(mask, float("-inf"))
            y = att.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, causal: bool, sdpa: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, causal, sdpa)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A character-level GPT: token and position embeddings, causal blocks, a tied-free head."""

    def __init__(
        self,
        vocab: int = 128,
        ctx: int = 64,
        dim: int = 128,
        layers: int = 4,
        heads: int = 4,
        sdpa: bool = False,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, True, sdpa) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


class ViT(nn.Module):
    def __init__(
        self,
        image: int = 32,
        patch: int = 4,
        dim: int = 128,
        layers: int = 4,
        heads: int = 4,
        classes: int = 10,
        sdpa: bool = False,
    ) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, dim, patch, patch)
        n = (image // patch) ** 2
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, False, sdpa) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, img: Tensor) -> Tensor:
        x = self.embed(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x[:, 0]))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.down(x))


class ResNet(nn.Module):
    """A ResNet-18-shaped CNN (BasicBlocks, BatchNorm, in-place ReLU, max and average pooling)."""

    def __init__(self, widths: tuple[int, ...] = (32, 64, 128, 256), classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        layers: list[nn.Module] = []
        cin = widths[0]
        for i, w in enumerate(widths):
            layers += [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
            cin = w
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.pool(self.layers(self.stem(x))).flatten(1))


@dataclass(frozen=True)
class ZooEntry:
    """A model and how to feed it: ``batch(n, device)`` gives inputs and targets."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, torch.device], tuple[Tensor, Tensor]]
    batch_size: int

    def loss(self, model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
        out = model(inputs)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def _tokens(vocab: int, ctx: int) -> Callable[[int, torch.device], tuple[Tensor, Tensor]]:
    def batch(n: int, device: torch.device) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(n)
        x = torch.randint(0, vocab, (n, ctx + 1), generator=g)
        return x[:, :-1].to(device), x[:, 1:].to(device)

    return batch


def _images(size: int, classes: int) -> Callable[[int, torch.device], tuple[Tensor, Tensor]]:
    def batch(n: int, device: torch.device) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(n)
        x = torch.randn(n, 3, size, size, generator=g)
        return x.to(device), torch.randint(0, classes, (n,), generator=g).to(device)

    return batch


def zoo(scale: str = "small") -> list[ZooEntry]:
    """The bench's models. ``tiny`` for tests, ``small`` for CPU benches, ``base`` for GPUs."""
    dims = {"tiny": (64, 2, 16, 4), "small": (128, 4, 64, 16), "base": (384, 6, 256, 64)}
    if scale not in dims:
        raise ValueError(f"zoo scale must be one of {sorted(dims)}, got {scale!r}")
    dim, layers, ctx, bs = dims[scale]
    widths = {"tiny": (8, 16, 32, 64), "small": (32, 64, 128, 256), "base": (64, 128, 256, 512)}
    return [
        ZooEntry("gpt", lambda: GPT(128, ctx, dim, layers, 4), _tokens(128, ctx), bs),
        ZooEntry("vit", lambda: ViT(32, 4, dim, layers, 4, 10), _images(32, 10), bs),
        ZooEntry("resnet", lambda: ResNet(widths[scale], 10), _images(32, 10), bs),
    ]
