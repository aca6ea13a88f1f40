"""Every environment variable torchstash reads, in one place."""

from __future__ import annotations

import os

#: ``auto`` (build kernels, fall back to the reference with one warning), ``off``
#: (always the pure-PyTorch reference) or ``require`` (a failed build is an error).
KERNELS = "TORCHSTASH_KERNELS"
#: Comma-separated plug-in (distribution or entry-point) names to skip; ``*`` skips all.
DISABLE_PLUGINS = "TORCHSTASH_DISABLE_PLUGINS"
#: Where compiled kernels are cached (default: ``~/.cache/torchstash/kernels``).
CACHE_DIR = "TORCHSTASH_CACHE_DIR"
#: Where the kernel sources live (default: the checkout's ``csrc/`` or the packaged copy).
CSRC_DIR = "TORCHSTASH_CSRC_DIR"
#: Seconds to wait for another process's kernel build (its lock) before using the
#: pure-PyTorch reference (default 600).
KERNEL_LOCK_WAIT = "TORCHSTASH_KERNEL_LOCK_WAIT"
#: ``off`` keeps the engine's saved-tensor hooks on every forward, where a steady trace that
#: only keeps tensors would run without them (:mod:`torchstash.engine.hookless`); read when a
#: model is applied.
HOOKLESS = "TORCHSTASH_HOOKLESS"


def get(name: str, default: str = "") -> str:
    return os.environ.get(name, default).strip()
