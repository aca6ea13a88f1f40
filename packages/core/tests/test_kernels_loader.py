"""The kernel loader: TORCHSTASH_KERNELS modes, guards, failure reporting, cache keys."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from torchstash import env
from torchstash.errors import KernelUnavailable
from torchstash.kernels import loader, pack_bits, philox_uniform
from torchstash.kernels.reference import pack_bits_ref

STATUS_KEYS = {
    "mode",
    "built",
    "variant",
    "build_dir",
    "digest",
    "build_seconds",
    "reasons",
    "error",
    "csrc_dir",
    "library",
    "notes",
    "cached",
    "attempted",
    "cache_root",
}


@pytest.fixture
def fresh_loader() -> Iterator[None]:
    """A forgotten memo before and after: the next test rebuilds (a no-op when loaded)."""
    loader._reset()
    yield
    loader._reset()


@pytest.fixture
def bogus_csrc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_loader: None) -> Path:
    monkeypatch.setenv(env.CSRC_DIR, str(tmp_path / "nowhere"))
    return tmp_path / "nowhere"


def test_repository_checkout_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.CSRC_DIR, raising=False)
    root, reason = loader.find_csrc()
    assert reason is None and root is not None
    assert (root / "bindings" / "ops.cpp").is_file()
    assert (root / "include" / "torchstash" / "philox.h").is_file()


def test_modes_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, expected in [
        ("", "auto"),
        ("AUTO", "auto"),
        (" off ", "off"),
        ("require", "require"),
    ]:
        monkeypatch.setenv(env.KERNELS, value)
        assert loader.mode() == expected
    monkeypatch.delenv(env.KERNELS)
    assert loader.mode() == "auto"


def test_invalid_mode_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.KERNELS, "sometimes")
    message = r"TORCHSTASH_KERNELS='sometimes' is not valid; use one of auto, off, require"
    with pytest.raises(ValueError, match=message):
        loader.load()
    with pytest.raises(ValueError, match=message):
        pack_bits(torch.zeros(3, dtype=torch.uint8), 2)
    info = loader.status()  # doctor must still be able to report
    assert info["mode"] == "invalid" and "sometimes" in info["reasons"][0]
    assert pack_bits(torch.ones(3, dtype=torch.uint8), 2, impl="ref").tolist() == [0b010101]


def test_require_with_missing_sources_names_the_reason(
    bogus_csrc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(env.KERNELS, "require")
    with pytest.raises(
        KernelUnavailable, match=r"TORCHSTASH_CSRC_DIR=.*nowhere.*missing .*bindings/ops\.cpp"
    ):
        loader.load()
    with pytest.raises(KernelUnavailable, match="TORCHSTASH_CSRC_DIR"):
        pack_bits(torch.zeros(3, dtype=torch.uint8), 2)  # impl="auto" is strict under require
    assert torch.equal(
        pack_bits(torch.ones(9, dtype=torch.uint8), 1, impl="ref"),
        pack_bits_ref(torch.ones(9, dtype=torch.uint8), 1),
    )
    info = loader.status()
    assert not info["built"] and any("TORCHSTASH_CSRC_DIR" in r for r in info["reasons"])


def test_auto_warns_once_and_falls_back(bogus_csrc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.KERNELS, "auto")
    codes = torch.randint(0, 4, (33,), dtype=torch.uint8)
    with pytest.warns(RuntimeWarning, match=r"TORCHSTASH_CSRC_DIR.*torchstash doctor"):
        got = pack_bits(codes, 2)
    assert torch.equal(got, pack_bits_ref(codes, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not loader.available("cpu")
        philox_uniform(5, 1)
    with pytest.raises(KernelUnavailable, match="TORCHSTASH_CSRC_DIR"):
        pack_bits(codes, 2, impl="kernel")


def test_status_does_not_warn(bogus_csrc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.KERNELS, "auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        info = loader.status()
    assert set(info) >= STATUS_KEYS and info["attempted"] and not info["built"]


def test_off_never_builds(fresh_loader: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.KERNELS, "off")
    assert loader.load() is False
    info = loader.status()
    assert info["mode"] == "off" and not info["attempted"] and not info["built"]
    assert info["reasons"] == ["TORCHSTASH_KERNELS=off"]


BUILD_FAILURE_SCRIPT = """
import json, warnings
from torchstash.errors import KernelUnavailable
from torchstash.kernels import loader, pack_bits
import torch
info = loader.status()
try:
    loader.require("cpu")
except KernelUnavailable as exc:
    info["raised"] = str(exc)
    info["cause"] = repr(exc.__cause__)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = pack_bits(torch.ones(9, dtype=torch.uint8), 1)
    pack_bits(torch.ones(9, dtype=torch.uint8), 1)
info["fallback"] = out.tolist()
info["warnings"] = [str(w.message) for w in caught]
print(json.dumps(info))
"""


def test_build_failure_is_reported_with_its_cause(tmp_path: Path) -> None:
    """A fresh process (this one may hold the real library already) builds broken sources."""
    root, _ = loader.find_csrc()
    if root is None:
        pytest.skip("no kernel sources")
    broken = tmp_path / "csrc"
    shutil.copytree(root, broken)
    (broken / "bindings" / "ops.cpp").write_text('#error "deliberately broken for a test"\n')
    environ = dict(os.environ)
    environ.update(
        {env.CSRC_DIR: str(broken), env.CACHE_DIR: str(tmp_path / "cache"), env.KERNELS: "auto"}
    )
    environ["PYTHONPATH"] = os.pathsep.join([*sys.path, environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", BUILD_FAILURE_SCRIPT],
        env=environ, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    if any("ninja" in r or "compiler" in r for r in info["reasons"]):
        pytest.skip("no toolchain: " + "; ".join(info["reasons"]))
    assert not info["built"] and info["reasons"][0].startswith("build failed")
    assert "deliberately broken" in info["error"]
    assert info["build_dir"].startswith(str(tmp_path / "cache"))
    assert "build failed" in info["raised"] and "deliberately broken" in info["cause"]
    assert info["fallback"] == [255, 1]
    assert len(info["warnings"]) == 1 and "torchstash doctor" in info["warnings"][0]


def test_a_second_library_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_loader: None
) -> None:
    monkeypatch.setenv(env.KERNELS, "auto")
    if not loader.status()["built"]:
        pytest.skip("compiled kernels unavailable")
    root, _ = loader.find_csrc()
    assert root is not None
    changed = tmp_path / "csrc"
    shutil.copytree(root, changed)
    (changed / "cpu" / "extra.cpp").write_text("// a different library\n")
    monkeypatch.setenv(env.CSRC_DIR, str(changed))
    loader._reset()
    info = loader.status()
    assert not info["built"] and "already loaded" in info["reasons"][0]


def test_status_after_a_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.KERNELS, "auto")
    info = loader.status()
    assert set(info) >= STATUS_KEYS
    if not info["built"]:
        pytest.skip("compiled kernels unavailable: " + "; ".join(info["reasons"]))
    assert info["variant"] == ("cuda" if loader.available("cuda") else "cpu")
    assert info["digest"] and info["build_dir"].endswith(info["digest"][:16])
    assert Path(info["library"]).is_file() and info["build_seconds"] >= 0
    assert info["reasons"] == [] and info["error"] is None


def test_digest_tracks_sources_and_variant(tmp_path: Path) -> None:
    root, _ = loader.find_csrc()
    if root is None:
        pytest.skip("no kernel sources")
    copy = tmp_path / "csrc"
    shutil.copytree(root, copy)
    before = loader.digest(copy, "cpu")
    assert before == loader.digest(root, "cpu")  # content, not location
    assert before != loader.digest(copy, "cuda")
    header = copy / "include" / "torchstash" / "philox.h"
    header.write_text(header.read_text() + "\n// changed\n")
    assert loader.digest(copy, "cpu") != before
    (copy / "README.md").write_text("docs do not matter")
    assert loader.digest(copy, "cpu") == loader.digest(copy, "cpu")


def test_cache_root_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(env.CACHE_DIR, str(tmp_path))
    assert loader.cache_root() == tmp_path
    monkeypatch.delenv(env.CACHE_DIR)
    assert loader.cache_root() == Path.home() / ".cache" / "torchstash" / "kernels"


def test_other_devices_are_not_served(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.KERNELS, "auto")
    assert not loader.available("meta")
    with pytest.raises(KernelUnavailable, match="device type 'meta'"):
        loader.require("meta")
    meta = pack_bits(torch.empty(17, dtype=torch.uint8, device="meta"), 4)
    assert meta.device.type == "meta" and meta.shape == (9,)


def test_guards_list_every_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_loader: None
) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    monkeypatch.setattr(cpp_extension, "get_cxx_compiler", lambda: "no-such-c++")
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory should go")
    monkeypatch.setenv(env.CACHE_DIR, str(blocker / "cache"))
    monkeypatch.setenv(env.KERNELS, "auto")
    reasons = loader.status()["reasons"]
    assert any("ninja is not installed" in r for r in reasons)
    assert any("'no-such-c++' is not on PATH" in r for r in reasons)
    assert any("not writable; set TORCHSTASH_CACHE_DIR" in r for r in reasons)
    monkeypatch.setenv(env.KERNELS, "require")
    with pytest.raises(KernelUnavailable, match="ninja.*no-such-c\\+\\+.*TORCHSTASH_CACHE_DIR"):
        loader.load()
