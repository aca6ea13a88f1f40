"""``python -m torchstash_bench.dropit``: the figures in the package README, measured.

``error``: the weight-gradient relative error ``|G - G_stock| / |G_stock|`` of every linear
layer of the demo's GPT (the same model, corpus and optimizer as ``torchstash demo``), trained
stock for ``--steps`` steps and then given one more batch, against gamma and scope; with
``dropit.random`` at the same drop rate for comparison, and both fills (each feature's
dropped mean, or DropIT's zeros). Input gradients are exact under
DropIT, so each layer's error comes from its own input alone.

``demo``: ``torchstash demo`` (same model, data and steps) with ``dropit.mink`` on the MLP and
attention projections (the LM head exact), on every linear layer, and with DropIT's
whole-tensor selection, for the held-out loss and step time against stock.

``bytes``: the saved bytes of one ``Linear(256, 256)`` input of shape (64, 128, 256) against
gamma and dtype, alone and with the kept values at int8 (when torchstash-quant is installed),
next to DropIT's int32-index arithmetic.

``zoo``: whole-model saved bytes on the bench zoo, against stock fp32 and against a stock
bf16-autocast step (exact accounting through ``torchstash.measure``).
"""

from __future__ import annotations

import argparse
import fnmatch
import math
from collections.abc import Sequence
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

import torchstash as ts
from torchstash.errors import PolicyError
from torchstash.policy import parse_spec
from torchstash.testing.models import ZooEntry, zoo
from torchstash_dropit import FILLS, SCOPES

from .common import byte_counts, key, megabytes, rows_table, write_rows, zoo_arguments
from .demo import build_model, lm_loss
from .demo_task import DemoConfig, load_corpus, train_starts, windows

GAMMAS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
#: The demo GPT's linear layers, by role (qualified-name globs).
GROUPS = {
    "attn.qkv": "blocks.*.attn.qkv",
    "attn.proj": "blocks.*.attn.proj",
    "mlp.fc1": "blocks.*.mlp.0",
    "mlp.fc2": "blocks.*.mlp.2",
    "head": "head",
}
#: ``demo`` runs: label -> policy. The LM head's input is not a projection: left exact.
PROJECTIONS = "dropit.mink, projections"
DROPIT_PROJECTIONS = "dropit.mink:scope=tensor, projections"
DEMO_POLICIES: dict[str, list[dict[str, Any]]] = {
    PROJECTIONS: [{"strategy": "dropit.mink"}, {"module": "head", "strategy": "none"}],
    DROPIT_PROJECTIONS: [
        {"strategy": "dropit.mink", "options": {"scope": "tensor"}},
        {"module": "head", "strategy": "none"},
    ],
}
DEMO_STRATEGIES = ("dropit.mink", "dropit.mink:scope=tensor")
ZOO_STRATEGIES = ("dropit.mink", "dropit.mink:scope=row", "dropit.mink>quant.int8")


# -- weight-gradient error on the demo model -------------------------------------------------


def trained_demo_model(steps: int, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The demo's GPT after ``steps`` stock steps, and the batch that would come next."""
    cfg = DemoConfig()
    corpus = load_corpus(cfg.corpus_bytes, cfg.val_fraction)
    starts = train_starts(corpus, cfg, steps + 1, seed)
    model = build_model(cfg, seed, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    for batch in starts[:steps]:
        x, y = windows(corpus.train, batch, cfg.ctx)
        opt.zero_grad(set_to_none=True)
        lm_loss(model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    x, y = windows(corpus.train, starts[steps], cfg.ctx)
    return model, x, y


def weight_grads(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, spec: str | None
) -> dict[str, torch.Tensor]:
    """The linear layers' weight gradients of one step, stock or under ``spec``."""
    model.zero_grad(set_to_none=True)
    handle = None
    if spec is not None:
        name, options = parse_spec(spec)
        handle = ts.apply(model, name, **options)
    try:
        lm_loss(model, x, y).backward()
    finally:
        if handle is not None:
            handle.remove()
    return {
        n: m.weight.grad.detach().clone()
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and m.weight.grad is not None
    }


def relative_errors(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> dict[str, float]:
    """``|dG| / |G|`` per layer group (norms summed over the group's layers) and ``all``."""
    out: dict[str, float] = {}
    for group, pattern in {**GROUPS, "all": "*"}.items():
        names = [n for n in ref if fnmatch.fnmatchcase(n, pattern)]
        num = sum(float((got[n] - ref[n]).double().square().sum()) for n in names)
        den = sum(float(ref[n].double().square().sum()) for n in names)
        out[group] = math.sqrt(num / den) if den else float("nan")
    return out


def error_vs_gamma(
    steps: int = 300,
    gammas: Sequence[float] = GAMMAS,
    scopes: Sequence[str] = SCOPES,
    random: bool = True,
) -> list[dict[str, Any]]:
    """One row per (strategy, scope, gamma): relative weight-gradient error per layer group."""
    model, x, y = trained_demo_model(steps)
    ref = weight_grads(model, x, y, None)
    specs = [
        (f"dropit.mink:gamma={g};scope={s};fill={f}", "mink", s, f, g)
        for s in scopes
        for f in FILLS
        for g in gammas
    ]
    if random:
        specs += [(f"dropit.random:p={g}", "random", "tensor", "zero", g) for g in gammas]
    rows = []
    for spec, strategy, scope, fill, gamma in specs:
        errors = relative_errors(ref, weight_grads(model, x, y, spec))
        row = {"strategy": strategy, "scope": scope, "fill": fill, "gamma": gamma, **errors}
        rows.append(row)
    return rows


def error_table(rows: list[dict[str, Any]], steps: int) -> Table:
    columns = [(c, key(c)) for c in ("strategy", "scope", "fill")]
    columns += [("gamma", key("gamma", "g"))]
    columns += [(g, key(g, ".3f")) for g in (*GROUPS, "all")]
    title = f"weight-gradient relative error, demo GPT after {steps} stock steps (CPU, fp32)"
    return rows_table(title, columns, rows, left=3)


# -- one linear input's saved bytes ------------------------------------------------------------

BYTES_CASES = (
    (torch.float16, 0.5),
    (torch.float16, 0.7),
    (torch.float16, 0.9),
    (torch.float16, 0.99),
    (torch.bfloat16, 0.9),
    (torch.float32, 0.9),
)


def linear_input_ratio(dtype: torch.dtype, gamma: float, then: str | None = None) -> float:
    """Stored / stock bytes of what a ``Linear(256, 256)`` saves for a (64, 128, 256) input
    (the input only: the weight is a parameter and never counted)."""
    torch.manual_seed(0)
    layer = nn.Linear(256, 256).to(dtype)
    x = torch.randn(64, 128, 256, dtype=dtype, requires_grad=True)
    policy: list[dict[str, Any]] = [
        {
            "strategy": f"dropit.mink>{then}" if then else "dropit.mink",
            "options": {"dropit.mink": {"gamma": gamma}} if then else {"gamma": gamma},
        }
    ]
    with ts.stash(policy=policy) as s:
        y = layer(x * 1)
    y.float().sum().backward()
    row = next(r for r in s.tally.rows.values() if r.module_type == "Linear")
    return row.stored_bytes / row.raw_bytes


def dropit_ratio(dtype: torch.dtype, gamma: float) -> float:
    """DropIT's storage: the kept values plus an int32 index each."""
    e = torch.finfo(dtype).bits // 8
    return (1 - gamma) * (e + 4) / e


def saved_bytes_table() -> list[dict[str, Any]]:
    then = "quant.int8" if "quant.int8" in ts.REGISTRY.names() else None
    rows = []
    for dtype, gamma in BYTES_CASES:
        rows.append(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "gamma": gamma,
                "mink": linear_input_ratio(dtype, gamma),
                "mink_int8": linear_input_ratio(dtype, gamma, then) if then else None,
                "dropit": dropit_ratio(dtype, gamma),
            }
        )
    return rows


def bytes_table(rows: list[dict[str, Any]]) -> Table:
    columns = [
        ("dtype", key("dtype")),
        ("gamma", key("gamma", "g")),
        ("dropit.mink", key("mink", ".3f")),
        (
            "dropit.mink>quant.int8",
            lambda r: "not installed" if r["mink_int8"] is None else f"{r['mink_int8']:.3f}",
        ),
        ("DropIT", key("dropit", ".3f")),
    ]
    title = "saved bytes of a Linear(256, 256) input (64, 128, 256), x dense"
    return rows_table(title, columns, rows, left=1)


# -- whole-model saved bytes on the bench zoo ------------------------------------------------


def zoo_saved_bytes(
    scale: str = "small", strategies: Sequence[str] = ZOO_STRATEGIES
) -> list[dict[str, Any]]:
    """Saved bytes of one training step of every zoo model, stock against each strategy."""
    rows = []
    for entry in zoo(scale):
        for spec in strategies:
            rows.append(_zoo_row(entry, spec))
    return rows


def _zoo_row(entry: ZooEntry, spec: str) -> dict[str, Any]:
    x, y = entry.batch(entry.batch_size, torch.device("cpu"))
    torch.manual_seed(0)
    model = entry.build()

    def step() -> None:
        model.zero_grad()
        entry.loss(model, x, y).backward()

    name, options = parse_spec(spec)
    fp32 = ts.measure(model, step, name, warmup=1, repeat=1, **options)
    with torch.autocast("cpu", torch.bfloat16):
        bf16 = ts.measure(model, step, name, warmup=1, repeat=1, **options)
    return {"model": entry.name, "strategy": spec, **byte_counts(fp32), **byte_counts(bf16, "bf16_"),
            "ratio_fp32": fp32.stored_bytes / fp32.raw_bytes,
            "ratio_bf16": bf16.stored_bytes / bf16.raw_bytes}  # fmt: skip


def zoo_table(rows: list[dict[str, Any]], scale: str) -> Table:
    columns = [
        ("model", key("model")),
        ("strategy", key("strategy")),
        ("stock MB", megabytes("raw_bytes")),
        ("saved MB", megabytes("stored_bytes")),
        ("x stock", key("ratio_fp32", ".3f")),
        ("bf16: x stock", key("ratio_bf16", ".3f")),
    ]
    title = f"whole-model saved bytes, bench zoo ({scale}), one step on CPU"
    return rows_table(title, columns, rows)


def demo(steps: int = 300, seed: int = 0, out: str = "demo-out/dropit") -> Any:
    """The demo with :data:`DEMO_STRATEGIES` and :data:`DEMO_POLICIES`; its result."""
    from .demo import run_demo

    return run_demo(steps, out, list(DEMO_STRATEGIES), seed, policies=DEMO_POLICIES)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchstash_bench.dropit")
    sub = parser.add_subparsers(dest="what", required=True)
    err = sub.add_parser("error", help="weight-gradient error against gamma on the demo GPT")
    err.add_argument("--steps", type=int, default=300, help="stock steps first (default 300)")
    err.add_argument("--gammas", default=",".join(map(str, GAMMAS)))
    err.add_argument("--scopes", default=",".join(SCOPES))
    err.add_argument("--no-random", action="store_true", help="leave out dropit.random")
    err.add_argument("--json", default=None, help="also write the rows to this file")
    b = sub.add_parser("bytes", help="one linear input's saved bytes against gamma and dtype")
    b.add_argument("--json", default=None, help="also write the rows to this file")
    d = sub.add_parser("demo", help="the demo's loss and step time, projections and all")
    d.add_argument("--steps", type=int, default=300)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", default="demo-out/dropit", help="folder for demo.json and demo.png")
    z = sub.add_parser("zoo", help="whole-model saved bytes on the bench zoo")
    zoo_arguments(z, ZOO_STRATEGIES)
    args = parser.parse_args(argv)
    console = Console()
    if args.what == "demo":
        return 1 if demo(args.steps, args.seed, args.out).stock.error else 0
    try:
        if args.what == "error":
            gammas = [float(g) for g in args.gammas.split(",") if g]
            scopes = [s for s in args.scopes.split(",") if s]
            rows = error_vs_gamma(args.steps, gammas, scopes, random=not args.no_random)
            console.print(error_table(rows, args.steps))
        elif args.what == "bytes":
            rows = saved_bytes_table()
            console.print(bytes_table(rows))
        else:
            rows = zoo_saved_bytes(args.scale, args.strategies)
            console.print(zoo_table(rows, args.scale))
    except (PolicyError, ts.errors.OptionError) as e:
        parser.error(str(e))
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
