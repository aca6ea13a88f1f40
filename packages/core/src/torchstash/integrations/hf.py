"""Hugging Face: one call on the model, as ``gradient_checkpointing_enable()`` is, or a
``Trainer`` callback that applies torchstash for the length of ``train()`` and logs it.

    from torchstash.integrations.hf import enable
    enable(model, "quant.int8")          # the model keeps the strategy until disable(model)

    trainer = Trainer(model, args, train_dataset=ds,
                      callbacks=[TorchstashTrainerCallback("quant.int8")])  # logs saved MB
"""

from __future__ import annotations

from typing import Any

from ..api import Handle, PolicyLike, apply, handle_of, remove
from . import Meter, missing

try:
    from transformers import TrainerCallback
except ImportError as e:
    raise missing("hf", "transformers", "hf") from e

__all__ = ["TorchstashTrainerCallback", "disable", "enable", "is_enabled"]


def enable(
    model: Any,
    strategy: str | None = "quant.int8",
    *,
    policy: PolicyLike | None = None,
    **options: Any,
) -> Handle:
    """Make ``model`` (a ``PreTrainedModel`` or any ``nn.Module``) save less for backward, in
    place, until :func:`disable`: the counterpart of ``model.gradient_checkpointing_enable()``
    and compatible with it. Returns the :class:`~torchstash.Handle` (``handle.tally`` counts
    what was saved). The weights, ``state_dict`` and ``save_pretrained`` are unchanged."""
    return apply(model, strategy if policy is None else None, policy=policy, **options)


def disable(model: Any) -> None:
    """Undo :func:`enable`: the model saves what stock PyTorch saves again."""
    remove(model)


def is_enabled(model: Any) -> bool:
    return handle_of(model) is not None


class TorchstashTrainerCallback(TrainerCallback):
    """Applies torchstash at ``on_train_begin``, adds what it saved to the logs, removes it at
    ``on_train_end``.

    At each ``on_log`` of a training run it adds ``torchstash/saved_mb``, ``stored_mb``,
    ``raw_mb`` (per optimizer step, averaged since the last log) and ``ratio`` (stored / raw)
    to the logs and to ``trainer.state.log_history``. Reporting integrations see them when
    this callback comes before theirs (``trainer.callback_handler.callbacks``; ``report_to``'s
    come first by default). The Trainer has no exception event: a ``train()`` that raised
    leaves torchstash applied until :meth:`remove` or the next ``train()``.
    """

    def __init__(
        self, strategy: str | None = None, *, policy: PolicyLike | None = None, **options: Any
    ) -> None:
        self.meter = Meter(strategy, policy, options)

    @property
    def handle(self) -> Handle | None:
        """The active handle during ``train()``; None before and after."""
        return self.meter.handle

    def remove(self) -> None:
        """Take torchstash off the model now (after a ``train()`` that raised)."""
        self.meter.stop()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if model is None:
            raise ValueError("the Trainer passed no model to on_train_begin")
        self.meter.start(model)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.meter.step()

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if logs is None:
            return
        metrics = self.meter.read()
        if not metrics:
            return
        logs.update(metrics)
        history = state.log_history
        if history and history[-1].get("step") == state.global_step:  # the entry just written
            history[-1].update(metrics)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.meter.stop()
