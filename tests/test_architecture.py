"""The architecture holds: the import contracts in pyproject.toml, checked on the installed
packages (the lint session runs the same check)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    """Plug-ins never import the engine, the op tracker or the recomputation; the library
    never imports its tools; no private module is reached from outside; no import loops."""
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(exe).exists():
        pytest.skip("import-linter is not installed (the lint session checks the contracts)")
    done = subprocess.run(
        [exe, "--no-cache", "--config", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_the_library_imports_without_its_tools() -> None:
    """Importing torchstash and every plug-in loads nothing from the lab (torchstash_bench) or
    the test helpers (torchstash.testing)."""
    code = (
        "import sys, torchstash, torchstash_quant, torchstash_dropit, torchstash_memsave\n"
        "import torchstash.registry as r; r.REGISTRY.load_all()\n"
        "print(sorted(m for m in sys.modules if m.startswith(('torchstash_bench', 'torchstash.testing'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip() == "[]"


def test_no_contract_lets_indirect_imports_through() -> None:
    """A forbidden contract that allows indirect imports passes a plug-in reaching the engine
    through any public module that re-exports it: every such contract checks the chains, with
    the public facade's own edges into the engine named one by one."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    forbidden = [c for c in config["contracts"] if c["type"] == "forbidden"]
    assert forbidden
    for contract in forbidden:
        assert contract.get("allow_indirect_imports", False) is False, contract["name"]
        for ignored in contract.get("ignore_imports", []):
            assert "*" not in ignored, (contract["name"], ignored)  # edges, not patterns
