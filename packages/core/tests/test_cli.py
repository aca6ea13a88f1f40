"""The torchstash command: list, doctor and build."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from torchstash.cli import main
from torchstash.registry import EntryPoint


def test_list_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    names = {s["name"] for s in data["strategies"]}
    assert {"none", "offload.cpu"} <= names


def test_list_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "offload.cpu" in out and "(core)" in out


def test_doctor_json_is_the_whole_of_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    """``doctor --json`` prints JSON alone on stdout (its tables go to stderr): parseable."""
    code = main(["doctor", "--json"])
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["kernels"]["mode"] in ("auto", "off", "require")
    assert data["torch"] and data["python"] and isinstance(data["plugins"], list)
    assert code == (1 if data["problems"] else 0)
    assert "doctor" in captured.err  # the tables, for a person reading the terminal
    # this torch (2.13 and up) inlines GraphModule saved-tensor hooks: docs/compile.md
    assert data["torch.compile"].startswith("graph saved-tensor hooks: yes")


def test_build_builds_the_kernels_ahead(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["build"])
    out = capsys.readouterr().out
    assert "kernels: mode=" in out
    assert code == (0 if "built (" in out else 1)


def test_python_dash_m_torchstash_runs_the_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torchstash", "--version"], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.startswith("torchstash "), done


def test_unknown_arguments_are_errors() -> None:
    with pytest.raises(SystemExit):
        main(["list", "--bogus"])


@pytest.fixture
def clashing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process registry with two plug-in clashes: ``none`` offered by a plug-in, and the
    ``quant`` prefix claimed by a second distribution."""
    import importlib.metadata as metadata
    import sys
    import types

    from torchstash import registry

    evil = types.ModuleType("fake_cli_evil")
    evil.register = lambda r: r.register("none", str, lossless=True, summary="evil")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_cli_evil", evil)

    class Dist:
        def __init__(self, name: str, eps: dict[str, str]) -> None:
            self.metadata, self.version = {"Name": name}, "6.6"
            self.entry_points = [metadata.EntryPoint(n, v, registry.GROUP) for n, v in eps.items()]

    fakes = [
        Dist("torchstash-evil", {"none": "fake_cli_evil:register"}),
        Dist("other-quant", {"quant": "fake_cli_evil:register"}),
        Dist("torchstash-quant", {"quant": "fake_cli_evil:register"}),
    ]
    monkeypatch.setattr(metadata, "distributions", lambda: fakes)
    monkeypatch.setattr(registry, "REGISTRY", registry.Registry(builtins=registry._core_builtins))


def test_list_prints_the_table_and_the_clashes(
    clashing: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["list"]) == 1
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "offload.cpu" in out and "CLASH" in out
    assert "strategy 'none' is offered twice: by torchstash 0.1.0 by torchstash-evil 6.6" in out
    assert "'quant' is claimed by 2 distributions: other-quant 6.6" in out
    assert main(["list", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [(s["name"], s["distribution"]) for s in data["strategies"]] == [
        ("none", "torchstash"),
        ("offload.cpu", "torchstash"),
    ]
    status = {p["prefix"]: (p["status"], p["error"]) for p in data["plugins"]}
    assert status["none"][0] == status["quant"][0] == "CLASH"
    assert "torchstash-evil 6.6" in status["none"][1]


def test_doctor_reports_the_clashes(clashing: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--no-build", "--json"]) == 1
    captured = capsys.readouterr()
    out = " ".join((captured.out + captured.err).split())
    assert "strategy 'none' is offered twice: by torchstash 0.1.0 by torchstash-evil 6.6" in out
    assert "torchstash-quant 6.6 (fake_cli_evil:register)" in out
    assert '"problems": 2' in out


def test_import_does_not_load_dynamo() -> None:
    """``import torchstash`` (every CLI call) leaves torch._dynamo alone: over a second, paid
    only by a model that is applied to (see torchstash.compiling)."""
    code = "import sys, torchstash, torchstash.cli; print('torch._dynamo' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "False", done


def test_a_command_of_a_distribution_not_installed_says_what_to_install(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``bench`` and ``demo`` come with torchstash-bench; without it the command names it."""
    import torchstash.cli as cli

    monkeypatch.setattr(cli, "_command_entry_points", dict)
    assert main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "torchstash-bench" in err and "pip install" in err


def test_a_command_from_an_entry_point_gets_its_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torchstash.cli as cli

    seen: list[list[str]] = []

    ep = EntryPoint(
        "demo", "x:main", "torchstash-bench", "0.1.0", lambda: lambda argv: seen.append(argv) or 3
    )
    monkeypatch.setattr(cli, "_command_entry_points", lambda: {"demo": ep})
    assert main(["demo", "--quick", "--steps", "2"]) == 3
    assert seen == [["--quick", "--steps", "2"]]
