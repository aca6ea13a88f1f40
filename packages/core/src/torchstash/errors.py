"""Errors raised by torchstash. Every message says what went wrong and what to do."""

from __future__ import annotations


class TorchstashError(Exception):
    """Base class of every torchstash error."""


class RegistryError(TorchstashError):
    """A strategy could not be registered or found."""


class DuplicateStrategyError(RegistryError):
    """Two providers offer the same strategy name."""


class UnknownStrategyError(RegistryError, KeyError):
    """No installed provider offers the requested strategy."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class PluginLoadError(RegistryError):
    """A plug-in's entry point failed to import or register; the cause is chained."""


class OptionError(TorchstashError, TypeError):
    """A strategy was given an option it does not take, or a bad value."""


class PolicyError(TorchstashError, ValueError):
    """A policy rule is malformed; the message names the rule (and line)."""


class CompressionError(TorchstashError):
    """A compressor failed on a saved tensor; the message names the tensor's site."""


class KernelUnavailable(TorchstashError):
    """A compiled kernel was required (TORCHSTASH_KERNELS=require) but could not be built."""


class ApplyError(TorchstashError):
    """A model could not be prepared (already applied, nothing to do, ...)."""


class NothingToRewriteWarning(UserWarning):
    """A rewrite-only strategy found no module to rewrite: the model is left as it was (a loop
    over ``torchstash.strategies()`` goes on; the handle removes cleanly)."""


class CompileFallbackWarning(UserWarning):
    """torch.compile met a model whose strategy cannot run in a compiled graph (said once)."""
