"""``torchstash bench``'s command line: the zoo table, or ``--compare`` beside the baselines."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape

from . import compare
from .common import default_device, jsonable, plural, split_names
from .harness import SCALES, bench_notes, bench_table, run_bench


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchstash bench",
        description="Measure saved-for-backward memory and step time of the model zoo "
        "under stock PyTorch and each installed strategy.",
    )
    p.add_argument("--scale", choices=SCALES, default="small", help="zoo size (default: small)")
    p.add_argument(
        "--strategies",
        type=split_names,
        default=None,
        help="comma-separated strategy names (default: every installed strategy)",
    )
    p.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    p.add_argument(
        "--repeat", type=int, default=None, help="timed steps per run (default: 3; --compare: 5)"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: all cores but one, <= 4)"
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="also write the rows as JSON to PATH; '-' prints JSON to stdout instead of the table",
    )
    c = p.add_argument_group(
        "--compare", "torchstash against checkpointing, SAC, save_on_cpu and torch.compile"
    )
    c.add_argument(
        "--compare",
        action="store_true",
        help="run stock, checkpoint, sac, save_on_cpu, compile-budget, the strategies and "
        "checkpoint+quant.int8 on the zoo and the demo task (--strategies may name any of "
        "them, and checkpoint+STRATEGY for any strategy)",
    )
    c.add_argument("--models", type=split_names, default=None, help="e.g. gpt,vit (default: all)")
    c.add_argument(
        "--demo-steps", type=int, default=300, help="demo training steps; 0 skips (default: 300)"
    )
    c.add_argument(
        "--budget", type=float, default=0.5, help="compile's activation_memory_budget (0.5)"
    )
    c.add_argument("--plot", metavar="PNG", default=None, help="write the Pareto plot to PNG")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``torchstash bench``: progress and table on the terminal, or JSON with ``--json``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compare:
        return compare.main(args)
    if args.models or args.plot:
        parser.error("--models and --plot need --compare")
    args.repeat = args.repeat or 3
    to_stdout = args.json == "-"
    console = Console(stderr=True, highlight=False) if to_stdout else Console(highlight=False)
    dev = torch.device(args.device) if args.device else default_device()
    rows = run_bench(args.scale, args.strategies, dev, args.repeat, console, threads=args.threads)
    text = json.dumps(jsonable(rows), indent=2)
    failed = 1 if any(r["error"] for r in rows) else 0  # the table shows each failure
    if to_stdout:
        print(text)
        return failed
    where = f"{dev} ({plural(rows[0]['threads'], 'thread')})" if dev.type == "cpu" else str(dev)
    title = f"torchstash bench: zoo scale {args.scale} on {where}, median of {args.repeat} steps"
    console.print(bench_table(rows, title))
    for line in bench_notes(rows):
        console.print(f"  {escape(line)}")
    console.print(
        "saved = bytes autograd kept for backward on the device in one step; ratio = raw / saved; "
        "time = median step time relative to stock's in this run."
    )
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        console.print(f"wrote {escape(str(path))}")
    return failed
