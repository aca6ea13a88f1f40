"""Every text the engine says: why a tensor was kept as it is, and the errors a failing
compressor turns into (naming the strategy, the compressor, its distribution, the module and
the tensor, and saying what to do)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..compressor import Compressor
from ..errors import CompressionError, KernelUnavailable
from ..site import Site

#: Why a tensor that needs no gradient, saved where no op is seen (an autograd Function's
#: ``save_for_backward``: a reentrant checkpoint's block inputs), is kept exact by lossy
#: strategies: such constants are masks (0 and the dtype's minimum, which no group code holds)
#: and rotary tables, shared by every block, so stored once anyway.
CONSTANT_REASON = (
    "a constant (no gradient) saved by an autograd Function: kept exact, as an attention "
    "mask or a rotary table must be"
)

#: Why a fused attention's output, log-sum-exp or mask is not coded by a lossy strategy.
FUSED_OUTPUT_REASON = (
    "a fused attention's output, log-sum-exp and mask are kept exact, or recomputed from its "
    "stored q, k, v in backward where its kernel allows: its backward reads them with q, k "
    "and v, and coded copies disagree with one another"
)
#: Why a fused attention's q, k, v are kept exact after all.
FUSED_EXACT_REASON = (
    "a fused attention whose output the engine cannot recompute (its kernel is not one it "
    "replays, it drops, or it has an attn_mask that a CUDA kernel takes only as torch "
    "converted it): its q, k, v are kept exact like its output"
)

#: Errors a compressor raises that keep their type (a note is added): users catch these by type
#: (an out-of-memory back-off, ``TORCHSTASH_KERNELS=require``); anything else is wrapped in a
#: :class:`~torchstash.errors.CompressionError` that names the strategy, the compressor, the module and the tensor.
KEEP_TYPE: tuple[type[BaseException], ...] = (
    torch.OutOfMemoryError,
    MemoryError,
    KernelUnavailable,
)


FORWARD_STATE = "the parameters, gradients and optimizer state are as they were"
BACKWARD_STATE = (
    "the parameters and optimizer state are as they were, but gradients may be partly "
    "accumulated: zero them (optimizer.zero_grad()) before the next step"
)


def tensor_text(site: Site, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype | None) -> str:
    """``(4, 16) torch.float32 tensor linear.input saved in module 'fc' (Linear)``."""
    what = f"{tuple(shape)} {dtype} tensor" if dtype is not None else "tensor"
    where = f"module {site.module!r}" if site.module else "<top level>"
    op = f"{site.op}.{site.role}" if site.op else (site.role or "tensor")
    return f"{what} {op} saved in {where} ({site.module_type or 'no module'})"


class Naming(Protocol):
    """Who built a compressor, for the messages (a :class:`~torchstash.plan.Plan`)."""

    def strategy_of(self, compressor: Compressor) -> str | None: ...

    def providers(self, strategy: str) -> str: ...


def _strategy_and_providers(names: Naming | None, compressor: Compressor) -> tuple[str | None, str]:
    strategy = None if names is None else names.strategy_of(compressor)
    provider = names.providers(strategy) if names is not None and strategy else ""
    return strategy, provider


def who(names: Naming | None, compressor: Compressor) -> str:
    """``strategy 'a' (compressor 'b', module.Class, from dist 1.0)``."""
    cls = type(compressor)
    parts = [f"compressor {compressor.name!r}", f"{cls.__module__}.{cls.__qualname__}"]
    strategy, provider = _strategy_and_providers(names, compressor)
    if provider:
        parts.append(f"from {provider}")
    head = f"strategy {strategy!r}" if strategy else "the op's own codec"
    return f"{head} ({', '.join(parts)})"


def advice(names: Naming | None, compressor: Compressor, site: Site) -> str:
    """What to do: a policy rule that leaves the site out, and whom to tell."""
    if site.module:
        rule: dict[str, str] = {"module": site.module, "strategy": "none"}
        what = f"module {site.module!r}"
    else:
        rule = {"op": site.op, "role": site.role, "strategy": "none"}
        what = "that tensor"
    provider = _strategy_and_providers(names, compressor)[1] or (
        f"the maintainers of {type(compressor).__module__}"
    )
    return (
        f"To train on, leave {what} out with the policy rule {rule!r} placed last, "
        f"or report this to {provider}"
    )


def released(count: int, nbytes: int) -> str:
    """What went back when a backward failed."""
    return (
        f"torchstash released the {count} tensors ({nbytes / 2**20:.2f} MiB) that forward "
        "pass stored, so a following backward through the same graph raises"
    )


def compress_note(names: Naming | None, compressor: Compressor, site: Site, t: torch.Tensor) -> str:
    """The note added to an error of :data:`KEEP_TYPE` raised in forward."""
    return (
        f"torchstash: raised in forward by {who(names, compressor)} compressing the "
        f"{tensor_text(site, t.shape, t.dtype)}; {FORWARD_STATE}"
    )


def compress_error(
    names: Naming | None, compressor: Compressor, site: Site, t: torch.Tensor, e: Exception
) -> CompressionError:
    """Any other error a compressor raised in forward."""
    return CompressionError(
        f"{who(names, compressor)} failed to compress the "
        f"{tensor_text(site, t.shape, t.dtype)}: {type(e).__name__}: {e}. "
        f"It was raised in forward: {FORWARD_STATE}. {advice(names, compressor, site)}"
    )


def restore_note(
    names: Naming | None, compressor: Compressor, site: Site, packed: Any, gone: str
) -> str:
    """The note added to an error of :data:`KEEP_TYPE` raised in backward."""
    return (
        f"torchstash: raised in backward by {who(names, compressor)} restoring the "
        f"{tensor_text(site, packed.shape, packed.dtype)}; {gone}; {BACKWARD_STATE}"
    )


def restore_error(
    names: Naming | None,
    compressor: Compressor,
    site: Site,
    packed: Any,
    gone: str,
    e: Exception,
) -> CompressionError:
    """Any other error a compressor raised in backward."""
    return CompressionError(
        f"{who(names, compressor)} failed to restore the "
        f"{tensor_text(site, packed.shape, packed.dtype)}: {type(e).__name__}: {e}. "
        f"It was raised in backward: {BACKWARD_STATE}; {gone}. "
        f"{advice(names, compressor, site)}"
    )


def released_error(site: Site) -> CompressionError:
    """A restore after an earlier backward through the same graph failed."""
    return CompressionError(
        f"the {tensor_text(site, (), None)} was released when an earlier backward "
        "through this graph raised; run the forward pass again"
    )


def modified_error(site: Site, shape: tuple[int, ...], version: int, expected: int) -> RuntimeError:
    """Stock's error for a saved tensor changed in place before backward, naming the site."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by "
        f"an inplace operation: the {shape} tensor ({site.describe()}) is at version "
        f"{version}; expected version {expected} instead. Avoid the in-place op or clone "
        "before it."
    )


def recompute_note(site: Site, shape: torch.Size) -> str:
    """The note added to an error raised while recomputing a save from its op's inputs."""
    return f"torchstash: raised recomputing the {tensor_text(site, shape, None)} from its op's stored inputs"
