"""The trainer callbacks: Lightning's ``TorchstashCallback`` and the Hugging Face Trainer's
``TorchstashTrainerCallback`` apply torchstash for the run, log what it saved, and leave the
model stock afterwards (on an exception too, for Lightning). Each is skipped with a reason where
its library is not installed; the import checks run everywhere."""

from __future__ import annotations

import csv
import importlib
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchstash as ts
from torchstash.errors import OptionError, UnknownStrategyError
from torchstash.testing.hooks import hook_total

FIELDS = {"torchstash/saved_mb", "torchstash/stored_mb", "torchstash/raw_mb", "torchstash/ratio"}


def _library(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception as e:  # ImportError, or a broken binary dependency's RuntimeError
        pytest.skip(f"{name} is not usable here: {type(e).__name__}: {str(e)[:120]}")


def _hooks(model: nn.Module) -> int:
    return hook_total(model)


# -- imports -----------------------------------------------------------------------------------


def test_imports_without_the_trainer_libraries() -> None:
    """``import torchstash`` loads no trainer library; an integration whose library is missing
    says which extra to install. One subprocess (importing torch takes seconds here)."""
    code = """
import sys
import torchstash, torchstash.integrations
libs = ("lightning", "pytorch_lightning", "transformers", "accelerate")
print("loaded:", sorted({m.split(".")[0] for m in sys.modules} & set(libs)))

class Block:  # refuses the trainer libraries: as if they were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in libs:
            raise ModuleNotFoundError(name)

sys.meta_path.insert(0, Block())
for name in ("lightning", "hf"):
    try:
        __import__("torchstash.integrations." + name)
    except ImportError as e:
        print(name, "->", e)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert "loaded: []" in out, out
    assert "lightning -> torchstash.integrations.lightning needs Lightning" in out, out
    assert 'pip install "torchstash[lightning]"' in out, out
    assert "hf -> torchstash.integrations.hf needs transformers" in out, out
    assert 'pip install "torchstash[hf]"' in out, out


# -- Lightning ---------------------------------------------------------------------------------


def _lightning_warnings(test: Any) -> Any:
    """Lightning's own warnings on a tiny CPU run, and its use of a torch API deprecated in
    2.10 (``LeafSpec``): third-party, nothing here to fix."""
    for w in (
        "ignore:.*does not have many workers:UserWarning",
        "ignore:.*LeafSpec.*is deprecated:FutureWarning",
    ):
        test = pytest.mark.filterwarnings(w)(test)
    return test


def _lightning() -> Any:
    return _library("lightning.pytorch")


def _tiny_module(pl: Any) -> Any:
    class Tiny(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            if getattr(self, "fail_at", None) == batch_idx:
                self.applied_at_fail = ts.handle_of(self)
                raise RuntimeError("boom")
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> Any:
            g = torch.Generator().manual_seed(0)
            data = torch.utils.data.TensorDataset(
                torch.randn(64, 32, generator=g), torch.randint(0, 4, (64,), generator=g)
            )
            return torch.utils.data.DataLoader(data, batch_size=16)

    return Tiny()


def _trainer(pl: Any, tmp_path: Path, callback: Any) -> Any:
    return pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        logger=pl.loggers.CSVLogger(tmp_path, name="run"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )


@_lightning_warnings
def test_lightning_callback_logs_and_removes(tmp_path: Path) -> None:
    pl = _lightning()
    from torchstash.integrations.lightning import TorchstashCallback

    module = _tiny_module(pl)
    hooks = _hooks(module)
    callback = TorchstashCallback("quant.int8")
    seen: list[tuple[ts.Handle | None, bool]] = []  # (handle, whether it was active then)

    class Spy(pl.Callback):  # type: ignore[misc, name-defined]
        def on_train_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            handle = ts.handle_of(pl_module)
            seen.append((handle, handle is not None and not handle.removed))

    trainer = _trainer(pl, tmp_path, callback)
    trainer.callbacks.append(Spy())
    trainer.fit(module)

    assert [active for _, active in seen] == [True] * 3
    first = seen[0][0]
    assert first is not None and all(h is first for h, _ in seen)  # one handle for the fit
    assert ts.handle_of(module) is None and callback.handle is None and first.removed
    assert _hooks(module) == hooks
    logged = trainer.logged_metrics
    assert set(logged) >= FIELDS
    assert 0 < float(logged["torchstash/ratio"]) < 0.5  # int8 codes: about a quarter of fp32
    assert float(logged["torchstash/saved_mb"]) > 0
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    steps = [r for r in rows if r.get("torchstash/saved_mb")]
    assert len(steps) == 3  # one row per training step, each with the fields
    raw = float(steps[0]["torchstash/raw_mb"])
    stored = float(steps[0]["torchstash/stored_mb"])
    assert raw - stored == pytest.approx(float(steps[0]["torchstash/saved_mb"]))


@_lightning_warnings
def test_lightning_callback_removes_on_exception(tmp_path: Path) -> None:
    pl = _lightning()
    from torchstash.integrations.lightning import TorchstashCallback

    module = _tiny_module(pl)
    module.fail_at = 1
    callback = TorchstashCallback("quant.int4")
    with pytest.raises(RuntimeError, match="boom"):
        _trainer(pl, tmp_path, callback).fit(module)
    assert module.applied_at_fail is not None and module.applied_at_fail.removed
    assert ts.handle_of(module) is None and callback.handle is None
    ts.apply(module, "none").remove()  # nothing left applied: a new apply is accepted


@_lightning_warnings
def test_lightning_callback_rejects_an_unknown_strategy_up_front() -> None:
    _lightning()
    from torchstash.integrations.lightning import TorchstashCallback

    with pytest.raises(UnknownStrategyError, match="quant.int9"):
        TorchstashCallback("quant.int9")
    with pytest.raises(OptionError):
        TorchstashCallback("quant.int8", bitz=4)


# -- Hugging Face Trainer ----------------------------------------------------------------------


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A tiny in-memory causal-LM data set: fixed random token ids, labels = inputs."""

    def __init__(self, n: int = 16, seq: int = 16, vocab: int = 128) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _hf_trainer(tmp_path: Path, callback: Any, **args: Any) -> Any:
    tf = _library("transformers")
    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=16, vocab_size=128, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = tf.GPT2LMHeadModel(cfg)
    targs = tf.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        **args,
    )
    return tf.Trainer(model=model, args=targs, train_dataset=_Tokens(), callbacks=[callback])


def test_hf_trainer_callback_logs_and_removes(tmp_path: Path, capsys: Any) -> None:
    _library("transformers")
    from torchstash.integrations.hf import TorchstashTrainerCallback

    callback = TorchstashTrainerCallback("quant.int8")
    trainer = _hf_trainer(tmp_path, callback)
    model = trainer.model
    hooks = _hooks(model)
    handles: list[ts.Handle | None] = []

    from transformers import TrainerCallback

    class Spy(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            handles.append(ts.handle_of(kw["model"]))

    trainer.add_callback(Spy())
    trainer.train()

    assert len(handles) == 3 and handles[0] is not None and handles[0] is handles[-1]
    assert handles[0].removed and ts.handle_of(model) is None and callback.handle is None
    assert _hooks(model) == hooks
    steps = [e for e in trainer.state.log_history if "loss" in e]
    assert len(steps) == 3 and all(set(e) >= FIELDS for e in steps)
    for e in steps:
        assert 0 < e["torchstash/ratio"] < 0.5  # int8 codes: about a quarter of fp32
        assert e["torchstash/saved_mb"] == pytest.approx(
            e["torchstash/raw_mb"] - e["torchstash/stored_mb"]
        )
    # The printer callback (after ours) shows them too.
    assert "torchstash/saved_mb" in capsys.readouterr().out


def test_hf_trainer_callback_counts_optimizer_steps(tmp_path: Path) -> None:
    _library("transformers")
    from torchstash.integrations.hf import TorchstashTrainerCallback

    runs = []
    for accumulate in (1, 2):
        trainer = _hf_trainer(
            tmp_path / str(accumulate),
            TorchstashTrainerCallback("none"),
            gradient_accumulation_steps=accumulate,
        )
        trainer.train()
        runs.append([e for e in trainer.state.log_history if "loss" in e])
    one, two = runs
    assert len(one) == len(two) == 3
    # Two micro-batches of one shape per optimizer step: twice the bytes, all stored as is.
    assert all(b["torchstash/raw_mb"] == 2 * a["torchstash/raw_mb"] for a, b in zip(one, two))
    assert all(e["torchstash/ratio"] == 1.0 and e["torchstash/saved_mb"] == 0 for e in one + two)


def test_hf_one_line_enable_trains_with_the_trainer_and_disables(tmp_path: Path) -> None:
    """``enable(model, strategy)``, as ``gradient_checkpointing_enable()``: the Trainer trains
    the model with it (alone and with checkpointing on), and ``disable`` makes it stock."""
    tf = _library("transformers")
    from torchstash.integrations.hf import disable, enable, is_enabled

    trainer = _hf_trainer(tmp_path, tf.TrainerCallback())
    model = trainer.model
    hooks, keys = _hooks(model), list(model.state_dict())
    handle = enable(model, "quant.int8")
    assert is_enabled(model)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    # int8 codes; GPT-2's SDPA with dropout keeps its attention saves exact (the README)
    assert handle.tally.raw_bytes > 2 * handle.tally.stored_bytes > 0
    disable(model)
    assert not is_enabled(model) and _hooks(model) == hooks and list(model.state_dict()) == keys
    checkpointed = _hf_trainer(tmp_path / "ckpt", tf.TrainerCallback())
    checkpointed.model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": False}
    )
    enable(checkpointed.model, "quant.int8")
    checkpointed.train()
    losses = [e["loss"] for e in checkpointed.state.log_history if "loss" in e]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    disable(checkpointed.model)
