"""The ``memsave`` strategy: swaps each layer it knows for its memory-saving class, in place."""

from __future__ import annotations

from collections import Counter

from torch import nn

from torchstash.errors import OptionError
from torchstash.plan import Swapped

from .modules import FAMILIES, MIXINS, memsave_class, torch_base, why_not


class MemSaveRewriter:
    """Rewrites the layers of the enabled families; remembers why others were left alone."""

    name = "memsave"

    def __init__(self, families: frozenset[str] = frozenset(FAMILIES)) -> None:
        unknown = families - set(FAMILIES)
        if unknown:
            raise OptionError(f"memsave: unknown layer families {sorted(unknown)}")
        self.families = families
        #: reason -> how many modules it kept as they are
        self.skipped: Counter[str] = Counter()

    def rewrite(self, module: nn.Module) -> Swapped | None:
        base = torch_base(type(module))
        if base is None or MIXINS[base].family not in self.families:
            return None
        why = why_not(module)
        if why is not None:
            self.skipped[why] += 1
            return None
        original = type(module)
        module.__class__ = memsave_class(original)

        def undo() -> None:
            module.__class__ = original

        return Swapped(module, undo)
