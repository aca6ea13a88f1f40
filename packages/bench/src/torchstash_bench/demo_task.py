"""The demo's task: its configuration, and the corpus it trains on (the Python standard
library's own source on this machine, so the demo runs offline) cut into windows."""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

VOCAB = 128  # ASCII; source files are almost entirely ASCII
UNK = 0  # every byte >= 128 maps here (NUL never occurs in source text)
SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
QUICK_STEPS = 12  # --quick caps the number of steps at this


@dataclass(frozen=True)
class DemoConfig:
    """Sizes of the model, data and schedule.

    The default takes about 20 s per 300-step run on one CPU thread (about 60 ms a step), so
    stock and a dozen strategies finish in about 5 minutes on a 2-core machine.
    """

    dim: int = 128
    layers: int = 4
    heads: int = 4
    ctx: int = 64
    batch: int = 12
    lr: float = 2e-3
    corpus_bytes: int = 3 << 20
    val_fraction: float = 0.1
    val_batches: int = 8
    log_every: int = 10
    tail: int = 20  # the final train loss is the mean of this many last steps
    timing_skip: int = 5  # first steps left out of the median step time

    @classmethod
    def quick(cls) -> DemoConfig:
        """A model and corpus small enough for tests: a few seconds in all."""
        return cls(
            dim=32,
            layers=1,
            heads=2,
            ctx=16,
            batch=4,
            corpus_bytes=64 << 10,
            val_batches=2,
            log_every=2,
            tail=4,
            timing_skip=1,
        )


# -- corpus ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    """Tokens (byte values, clipped to ASCII) of the standard library's source."""

    train: Tensor
    val: Tensor
    root: str
    files: int
    nbytes: int

    def info(self) -> dict[str, Any]:
        """Where the text came from and how it was split (for demo.json)."""
        return {
            "root": self.root,
            "files": self.files,
            "bytes": self.nbytes,
            "train_tokens": len(self.train),
            "val_tokens": len(self.val),
        }


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path) -> Iterator[Path]:
    """``.py`` files under ``root``, sorted (so deterministic), skipping tests and site-packages."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath, name)


def encode(data: bytes) -> Tensor:
    """Bytes to token ids: ASCII as is, anything else to :data:`UNK`."""
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
    ids[ids >= VOCAB] = UNK
    return ids


def load_corpus(max_bytes: int, val_fraction: float = 0.1, root: Path | None = None) -> Corpus:
    """Up to ``max_bytes`` of source; the last ``val_fraction`` of it is held out for validation."""
    root = root or stdlib_root()
    chunks: list[bytes] = []
    total = files = 0
    for path in stdlib_sources(root):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        files += 1
        if total >= max_bytes:
            break
    if total < 4096:
        raise RuntimeError(f"found only {total} bytes of Python source under {root}")
    ids = encode(b"".join(chunks))
    cut = int(len(ids) * (1 - val_fraction))
    return Corpus(ids[:cut], ids[cut:], str(root), files, total)


def windows(tokens: Tensor, starts: Tensor, ctx: int) -> tuple[Tensor, Tensor]:
    """Inputs and next-token targets for sequences starting at ``starts``."""
    seq = tokens[starts[:, None] + torch.arange(ctx + 1)]
    return seq[:, :-1], seq[:, 1:]


def train_starts(corpus: Corpus, cfg: DemoConfig, steps: int, seed: int) -> Tensor:
    """Every step's batch, drawn once from ``seed`` so that every run sees the same data."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, len(corpus.train) - cfg.ctx - 1, (steps, cfg.batch), generator=g)


def val_starts(corpus: Corpus, cfg: DemoConfig) -> Tensor:
    """Held-out sequences spread evenly over the validation slice."""
    n = cfg.val_batches * cfg.batch
    top = max(len(corpus.val) - cfg.ctx - 2, 0)
    return torch.linspace(0, top, n).long().view(cfg.val_batches, cfg.batch)
