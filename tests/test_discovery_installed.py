"""With every package installed: the real plug-ins are discovered and listed."""

from __future__ import annotations

import json
import subprocess
import sys

import torchstash

PLUGINS = {
    "quant": "torchstash-quant",
    "dropit": "torchstash-dropit",
    "memsave": "torchstash-memsave",
}


def test_all_plugins_discovered_and_loaded() -> None:
    records = {r.prefix: r for r in torchstash.REGISTRY.plugins()}
    for prefix, dist in PLUGINS.items():
        assert prefix in records, f"{dist} not discovered; installed? {sorted(records)}"
        assert records[prefix].loaded, records[prefix].error
        assert records[prefix].distribution == dist


def test_cli_lists_core_and_plugins() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "torchstash.cli", "list", "--json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    data = json.loads(out)
    assert {p["distribution"] for p in data["plugins"]} >= set(PLUGINS.values())
    assert {"none", "offload.cpu"} <= {s["name"] for s in data["strategies"]}


def test_disable_plugins_env_in_a_fresh_process() -> None:
    code = (
        "import torchstash, json;"
        "print(json.dumps([[r.prefix, r.disabled] for r in torchstash.REGISTRY.plugins()]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "TORCHSTASH_DISABLE_PLUGINS": "quant"},
    ).stdout
    states = dict(json.loads(out))
    assert states["quant"] is True and states["dropit"] is False
