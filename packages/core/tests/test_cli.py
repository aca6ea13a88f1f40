"""The torchstash command: list and doctor."""

from __future__ import annotations

import json

import pytest

from torchstash.cli import main


def test_list_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    names = {s["name"] for s in data["strategies"]}
    assert {"none", "offload.cpu"} <= names


def test_list_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "offload.cpu" in out and "(core)" in out


def test_doctor_reports_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", "--json"])
    out = capsys.readouterr().out
    assert "torch" in out and "kernels" in out
    data = json.loads(out[out.index("{\n") :])
    assert data["kernels"]["mode"] in ("auto", "off", "require")
    assert code == (1 if data["problems"] else 0)


def test_unknown_arguments_are_errors() -> None:
    with pytest.raises(SystemExit):
        main(["list", "--bogus"])
