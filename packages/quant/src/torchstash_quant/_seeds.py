"""The core's per-compressor seed streams (kept under this name for existing imports)."""

from torchstash.seeds import SeedStream

__all__ = ["SeedStream"]
