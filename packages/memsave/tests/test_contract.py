"""memsave's rewriter passes the core's rewriter contract (exact, and never holding more)."""

from __future__ import annotations

from torchstash.testing.contract import RewriterContract
from torchstash_memsave.rewriter import MemSaveRewriter


class TestMemSave(RewriterContract):
    lossless = True
    max_held_share = 0.75  # measured 0.62 of stock: the ReLUs keep bits, the pool an index

    def make_rewriter(self) -> object:
        return MemSaveRewriter()
