"""The ``torchstash`` command (also ``python -m torchstash``): ``list``, ``doctor``, ``build``,
and the commands other distributions provide (``bench`` and ``demo``, from torchstash-bench)."""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ._version import __version__
from .errors import DuplicateStrategyError
from .registry import EntryPoint, PluginRecord, entry_points_of


def _console(*, stderr: bool = False) -> Console:
    return Console(highlight=False, stderr=stderr)


def _build_kernels(console: Console, *, build: bool = True) -> dict[str, Any]:
    """The kernels' status, building them first when asked: a status line on a terminal, one
    line otherwise, so the minute a first build takes is not a silent one."""
    from . import kernels
    from .kernels import loader

    before = kernels.status(build=False)
    if (
        not build
        or before.get("attempted")
        or before.get("mode") not in ("auto", "require")
        or loader.cached()
    ):
        return kernels.status(build=build)
    message = "building the compiled kernels (first use: up to a few minutes; cached after)"
    if console.is_terminal:
        with console.status(message):
            return kernels.status(build=True)
    console.print(f"torchstash: {message}")
    return kernels.status(build=True)


def _kernel_line(st: dict[str, Any]) -> str:
    if st.get("built"):
        cached = " from the cache" if st.get("cached") else ""
        return (
            f"built ({st.get('variant')}, {st.get('build_seconds') or 0.0:.1f}s{cached}) "
            f"in {st.get('build_dir')}"
        )
    return "using the pure-PyTorch reference"


def cmd_list(args: argparse.Namespace) -> int:
    """Installed strategies and plug-ins; exit 1 if a plug-in failed to load or clashed."""
    from .registry import REGISTRY

    console = _console()
    strategies = REGISTRY.strategies()
    plugins = REGISTRY.plugins()
    if args.json:
        print(
            json.dumps(
                {
                    "strategies": [s.describe() for s in strategies],
                    "plugins": [_plugin_dict(p, strategies) for p in plugins],
                },
                indent=2,
            )
        )
        return 1 if _failed(plugins) else 0
    # one line per strategy (cut to the terminal's width); --verbose wraps and adds the options
    wrap = bool(args.verbose)
    t = Table(title=f"torchstash {__version__}: strategies (then presets, which set options)")
    names = {s.name: f"{s.name} (preset)" if s.preset else s.name for s in strategies}
    t.add_column("strategy", no_wrap=True, min_width=max(map(len, names.values()), default=8))
    t.add_column("from", no_wrap=True, min_width=7)
    t.add_column("lossless", no_wrap=True, min_width=8)
    if wrap:
        t.add_column("options")
    t.add_column("summary")
    # what is left of the terminal's width for the summary (borders: 3 a column, 1 more)
    room = console.width - max(map(len, names.values()), default=8) - 7 - 8 - 13
    room = max(room, 20)

    def cut(text: str) -> str:
        return text if wrap or len(text) <= room else text[: room - 1] + "…"

    for s in sorted(strategies, key=lambda s: (s.preset, s.name)):
        cells = [
            names[s.name],
            s.distribution.removeprefix("torchstash-").replace("torchstash", "core"),
            "yes" if s.lossless else "no",
            *([", ".join(s.options())] if wrap else []),
            cut(s.summary),
        ]
        t.add_row(*cells)
    console.print(t)
    p = Table(title="plug-ins (entry point group torchstash.plugins)")
    for col in ("prefix", "distribution", "version", "status", "strategies"):
        p.add_column(col)
    p.add_row("(core)", "torchstash", __version__, "built in", _count(strategies, "torchstash"))
    for rec in plugins:
        d = _plugin_dict(rec, strategies)
        p.add_row(rec.prefix, rec.distribution, rec.version, d["status"], str(d["strategies"]))
    console.print(p)
    _print_failures(console, plugins, tracebacks=False)
    return 1 if _failed(plugins) else 0


def _count(strategies: Sequence[Any], dist: str) -> str:
    return str(sum(1 for s in strategies if s.distribution == dist))


def _status(rec: PluginRecord) -> str:
    if rec.error is not None:
        return "CLASH" if isinstance(rec.error, DuplicateStrategyError) else "FAILED"
    return "loaded" if rec.loaded else "disabled" if rec.disabled else "not loaded"


def _plugin_dict(rec: PluginRecord, strategies: Sequence[Any]) -> dict[str, Any]:
    return {
        "prefix": rec.prefix,
        "distribution": rec.distribution,
        "version": rec.version,
        "target": rec.target,
        "status": _status(rec),
        "error": None if rec.error is None else str(rec.error) or repr(rec.error),
        "strategies": int(_count(strategies, rec.distribution)),
    }


def _failed(plugins: Sequence[PluginRecord]) -> list[PluginRecord]:
    return [rec for rec in plugins if rec.error is not None]


def _print_failures(console: Console, plugins: Sequence[PluginRecord], *, tracebacks: bool) -> None:
    """A clash in full (it names both sides); a failure with its traceback in ``doctor``."""
    for rec in _failed(plugins):
        assert rec.error is not None
        if isinstance(rec.error, DuplicateStrategyError):
            console.print(f"[red]plug-in prefix {rec.prefix!r} clashes:[/red]")
            console.print(str(rec.error), markup=False)
        else:
            console.print(f"[red]{rec.distribution} ({rec.target}) failed to load:[/red]")
            lines = traceback.format_exception(rec.error) if tracebacks else [repr(rec.error)]
            console.print("".join(lines).rstrip(), markup=False)


def _first_line(cmd: list[str]) -> str:
    exe = shutil.which(cmd[0])
    if exe is None:
        return "not found"
    try:
        out = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{exe}: {e}"
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    return f"{lines[-1] if cmd[0] == 'nvcc' else lines[0]} ({exe})" if lines else exe


def cmd_doctor(args: argparse.Namespace) -> int:
    """Environment, kernel build status and plug-in load errors; exit 1 if something is broken."""
    import torch
    from torch.utils import cpp_extension

    from .compiling import graph_hooks_support
    from .registry import REGISTRY

    # with --json the tables go to stderr, so stdout is the JSON alone
    console = _console(stderr=args.json)
    problems = 0
    t = Table(title=f"torchstash {__version__} doctor", show_header=False)
    t.add_column("what")
    t.add_column("status")
    cuda = (
        f"yes: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        if torch.cuda.is_available()
        else "no GPU visible"
    )
    facts = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": f"{torch.__version__} (CUDA build: {torch.version.cuda or 'no'})",
        "CUDA device": cuda,
        "C++ compiler": _first_line([cpp_extension.get_cxx_compiler(), "--version"]),
        "ninja": "yes" if cpp_extension.is_ninja_available() else "not found (pip install ninja)",
        "nvcc": _first_line(["nvcc", "--version"]),
        "torch.compile": graph_hooks_support(),
    }
    for what, status in facts.items():
        t.add_row(what, status)
    st = _build_kernels(console, build=not args.no_build)
    built = st.get("built")
    t.add_row("kernels", f"mode={st.get('mode')}: {_kernel_line(st)}")
    for reason in st.get("reasons") or []:
        t.add_row("", f"[yellow]{reason}[/yellow]")
    if st.get("mode") == "require" and not built:
        problems += 1
    console.print(t)
    p = Table(title="plug-ins")
    for col in ("prefix", "distribution", "status"):
        p.add_column(col)
    plugins = REGISTRY.plugins()
    for rec in plugins:
        status = _status(rec)
        if rec.error is not None:
            problems += 1
            detail = "" if status == "CLASH" else f" {escape(repr(rec.error))}"  # it is below
            status = f"[red]{status}[/red]{detail}"
        p.add_row(rec.prefix, f"{rec.distribution} {rec.version}", status)
    console.print(p)
    _print_failures(console, plugins, tracebacks=True)
    if args.json:
        report = {
            "version": __version__,
            **{k.lower().replace(" ", "_"): v for k, v in facts.items()},
            "kernels": st,
            "plugins": [_plugin_dict(rec, REGISTRY.strategies()) for rec in plugins],
            "problems": problems,
        }
        print(json.dumps(report, indent=2, default=str))
    return 1 if problems else 0


def cmd_build(args: argparse.Namespace) -> int:
    """Build the compiled kernels now (what the first training step would otherwise do);
    exit 1 when they could not be built."""
    console = _console()
    st = _build_kernels(console)
    console.print(f"kernels: mode={st.get('mode')}: {_kernel_line(st)}")
    for reason in st.get("reasons") or []:
        console.print(f"  {escape(reason)}")
    return 0 if st.get("built") else 1


#: the entry point group whose commands ``torchstash`` runs besides its own (``bench`` and
#: ``demo`` come from torchstash-bench: the lab is not part of the library's install)
COMMANDS_GROUP = "torchstash.commands"
#: the commands the core's help names, and the distribution that provides them
KNOWN_COMMANDS = {
    "bench": ("model zoo x every strategy (see `torchstash bench -h`)", "torchstash-bench"),
    "demo": (
        "train a char-level GPT with each strategy (see `torchstash demo -h`)",
        "torchstash-bench",
    ),
}


def _command_entry_points() -> dict[str, EntryPoint]:
    return {ep.prefix: ep for ep in entry_points_of(COMMANDS_GROUP)}


def cmd_external(name: str, rest: list[str]) -> int:
    """A command another distribution provides (entry point group ``torchstash.commands``):
    ``main(argv)``, its exit status returned; a clear error naming what to install when none
    provides it."""
    ep = _command_entry_points().get(name)
    if ep is None:
        dist = KNOWN_COMMANDS.get(name, ("", "a torchstash plug-in"))[1]
        _console(stderr=True).print(
            f"torchstash {name}: this command comes with {dist}, which is not installed here; "
            f'pip install "{dist}" (or "torchstash[bench]"), or from a checkout '
            f"`python3 -m nox -s {name}`"
        )
        return 2
    return int(ep.load()(rest) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="torchstash", description="Train in less memory: shrink what autograd saves."
    )
    parser.add_argument("--version", action="version", version=f"torchstash {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="installed strategies and plug-ins")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("-v", "--verbose", action="store_true", help="options and whole summaries")
    p = sub.add_parser("doctor", help="torch, CUDA, compiler, kernels, plug-in errors")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-build", action="store_true", help="do not try to build the kernels")
    sub.add_parser("build", help="build the compiled kernels now, before the first step needs them")
    external = {name: help for name, (help, _) in KNOWN_COMMANDS.items()}
    for ep in _command_entry_points().values():
        if ep.prefix not in ("list", "doctor", "build"):  # the core's own come first
            external.setdefault(ep.prefix, f"from {ep.distribution}")
    for name, help in external.items():
        sub.add_parser(name, help=help, add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command in external:
        return cmd_external(args.command, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "build":
        return cmd_build(args)
    return cmd_list(args) if args.command == "list" else cmd_doctor(args)


if __name__ == "__main__":
    sys.exit(main())
