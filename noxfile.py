"""Sessions for the torchstash monorepo. `python3 -m nox` runs the default set (what CI runs).

torch comes from TORCHSTASH_TORCH (default torch==2.13.0, the CPU wheel on our machines):
an unpinned torch would pull the multi-GB CUDA build onto a CPU box.
"""

from __future__ import annotations

import os
import shutil
import tomllib
from pathlib import Path

import nox

nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "virtualenv"
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True
nox.options.sessions = [
    "lint", "typecheck", "tests", "integration", "ecosystem", "kernels", "floors",
]  # fmt: skip

TORCH = os.environ.get("TORCHSTASH_TORCH", "torch==2.13.0")
# The ecosystem session's pair: PyPI's torchvision does not load beside the 2.13.0 CPU wheel,
# while torch 2.14.1 with torchvision 0.29.1 (a CUDA build, about 5.5 GB, that runs on the CPU)
# installs from these machines' disk and runs timm and torchvision's models.
ECOSYSTEM_TORCH = os.environ.get("TORCHSTASH_ECOSYSTEM_TORCH", "torch==2.14.1")
TORCHVISION = os.environ.get("TORCHSTASH_TORCHVISION", "torchvision==0.29.1")
#: every package under packages/ but the core (the plug-ins and the lab, ``bench``): a new
#: plug-in is linted, typed and tested the day its folder (with a pyproject.toml) exists
PLUGINS = sorted(
    p.name
    for p in Path(__file__).parent.joinpath("packages").iterdir()
    if p.name != "core" and (p / "pyproject.toml").is_file()
)
TEST_DEPS = ["pytest>=8", "numpy", "hypothesis>=6", "import-linter>=2.1"]
#: the floors packages/core/pyproject.toml declares, installed exactly by the floors session
FLOORS = {
    "torch": "2.13.0", "rich": "13.3.0", "ninja": "1.11.1", "numpy": "1.26.0", "filelock": "3.13.1",
}  # fmt: skip
SRC_DIRS = ["packages/core/src", *(f"packages/{p}/src" for p in PLUGINS)]


def _local_needs(package: str) -> list[str]:
    """``package`` and the packages of this repository it depends on (the lab depends on every
    plug-in): installed from here, never looked up on an index."""
    here = Path(__file__).parent / "packages"
    local = {
        tomllib.loads((p / "pyproject.toml").read_text())["project"]["name"]: p.name
        for p in here.iterdir()
        if (p / "pyproject.toml").is_file()
    }
    project = tomllib.loads((here / package / "pyproject.toml").read_text())["project"]
    needs = [package]
    for requirement in project.get("dependencies", []):
        name = requirement.split("~")[0].split("=")[0].split(">")[0].split("<")[0].strip()
        if name in local:
            needs += [n for n in _local_needs(local[name]) if n not in needs]
    return needs


def _install(
    session: nox.Session, *packages: str, extras: dict[str, str] | None = None, torch: str = TORCH
) -> None:
    """torch first (pinned), then our packages (and the ones of ours they need) as real,
    non-editable installs; ``extras`` maps a package to the extras it is installed with."""
    session.install(torch)
    names: list[str] = []
    for package in packages:
        names += [n for n in _local_needs(package) if n not in names]
    extras = extras or {}
    paths = [f"./packages/{p}" + (f"[{extras[p]}]" if p in extras else "") for p in names]
    session.install(torch, *paths, *TEST_DEPS)  # torch again: no dependency may swap it


def _pytest(session: nox.Session, *paths: str) -> None:
    session.run("python", "-m", "pytest", "-q", "-m", "not slow", *paths, *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, and the import contracts in pyproject.toml (plug-ins off the engine's internals,
    the library off its tools, no import loops): import-linter reads the installed sources."""
    session.install("ruff>=0.6", "import-linter>=2.1")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.install("--no-deps", *(f"./packages/{p}" for p in ["core", *PLUGINS]))
    session.run("lint-imports", "--no-cache")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install("mypy>=1.10", "rich")
    session.run("mypy", *SRC_DIRS)


@nox.session
@nox.parametrize("package", ["core", *PLUGINS], ids=["core", *PLUGINS])
def tests(session: nox.Session, package: str) -> None:
    """One package's own tests in an isolated install: the core alone, the core plus one
    plug-in, or the lab with all it measures."""
    _install(session, package)  # a plug-in brings the core; the lab, everything
    _pytest(session, f"packages/{package}/tests")


@nox.session
def integration(session: nox.Session) -> None:
    """Every package installed together: real discovery, registry-wide contract, training."""
    _install(session, "core", *PLUGINS)
    _pytest(session, "tests")


@nox.session
def ecosystem(session: nox.Session) -> None:
    """Models and trainers users bring: transformers, timm, torchvision, Lightning, HF Trainer,
    on ECOSYSTEM_TORCH with TORCHVISION (every strategy on each model: tests/ecosystem)."""
    _install(session, "core", *PLUGINS, extras={"core": "lightning,hf"}, torch=ECOSYSTEM_TORCH)
    session.install(ECOSYSTEM_TORCH, TORCHVISION, "timm")
    # A torchvision built for another torch does not load (`import torchvision` raises a
    # RuntimeError); the session then fails here, naming the pair, instead of its tests
    # skipping timm and torchvision's models unseen.
    probe = (
        "try:\n import torchvision, timm\n print('vision-ok')\nexcept Exception as e:\n print(e)"
    )
    out = session.run_install("python", "-c", probe, silent=True)
    if isinstance(out, str) and "vision-ok" not in out:
        session.error(
            f"{TORCHVISION} or timm does not load with {ECOSYSTEM_TORCH} ({out.strip()}); set "
            "TORCHSTASH_ECOSYSTEM_TORCH and TORCHSTASH_TORCHVISION to a matching pair"
        )
    _pytest(session, "tests/ecosystem")


@nox.session
def floors(session: nox.Session) -> None:
    """The core's suite with every dependency at the floor its metadata declares (a floor we
    do not test is a promise we cannot keep)."""
    pins = [f"{name}=={version}" for name, version in FLOORS.items()]
    session.install(*pins)
    session.install(*pins, "./packages/core", "pytest>=8", "hypothesis>=6", "import-linter>=2.1")
    probe = "; ".join(
        f"import importlib.metadata as m; assert m.version({n!r}).split('+')[0] == {v!r}, "
        f"({n!r}, m.version({n!r}))"
        for n, v in FLOORS.items()
    )
    session.run("python", "-c", probe)
    _pytest(session, "packages/core/tests")


@nox.session
def kernels(session: nox.Session) -> None:
    """CPU build and parity, the speed table against the reference (fails only where a kernel is
    slower than it), nvcc -c on every .cu."""
    _install(session, "core")
    session.run("torchstash", "build")  # ahead of the tests, as a user's setup step would
    _pytest(session, "packages/core/tests/test_kernels.py")
    # The speed table is a report: a wall-time gate on a shared 2-core machine fails at
    # random (unpack_bits measured 4.2-4.5x against a gate of 5x on an idle one). Only a
    # kernel slower than its pure-PyTorch reference, i.e. a broken one, fails the run.
    session.run(
        "python", "-m", "torchstash.kernels.bench", "--mib", "64", "--threads", "1", "--check", "1"
    )
    if shutil.which("nvcc"):
        session.run("python", "-m", "torchstash.kernels.nvcc_check")
    else:
        session.log("nvcc not found: CUDA sources not compile-checked")


@nox.session
def demo(session: nox.Session) -> None:
    """The README's first command: train a char-level GPT with stock PyTorch and each strategy."""
    _install(session, "bench", extras={"bench": "plot"})
    session.run("torchstash", "demo", *session.posargs)


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """The built-in model zoo x every installed strategy."""
    _install(session, "bench")
    session.run("torchstash", "bench", *session.posargs)


@nox.session(default=False)
def compare(session: nox.Session) -> None:
    """torchstash against checkpointing, SAC, save_on_cpu and torch.compile (bench --compare).

    Arguments after -- go to the command, e.g. `nox -s compare -- --plot compare.png`."""
    _install(session, "bench", extras={"bench": "plot"})
    session.run("torchstash", "bench", "--compare", *session.posargs)


@nox.session(default=False)
def convergence(session: nox.Session) -> None:
    """Validation loss against stock's for every strategy on an SDPA GPT, a manual-attention
    GPT and a BatchNorm/SE CNN, 300 steps each, with each strategy's target.

    Arguments after -- go to scripts/convergence.py, e.g.
    `nox -s convergence -- --threads 1 --json conv.json --markdown conv.md --check`."""
    _install(session, "core", *PLUGINS)
    session.install("rich")
    session.run("python", "scripts/convergence.py", *session.posargs)


@nox.session(default=False)
def slow(session: nox.Session) -> None:
    """Long-running tests (marked slow)."""
    _install(session, "core", *PLUGINS)
    session.run("python", "-m", "pytest", "-q", "-m", "slow and not cuda", "packages", "tests")


@nox.session(venv_backend="none", default=False, tags=["gpu"])
def gpu(session: nox.Session) -> None:
    """On a GPU machine with the packages installed: the cuda tests with kernels required."""
    session.env["TORCHSTASH_KERNELS"] = "require"
    session.run("python", "-m", "pytest", "-q", "-m", "cuda", "packages", "tests")
