"""The kernel loader: TORCHSTASH_KERNELS modes, guards, failure reporting, cache keys, the
build lock."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from filelock import FileLock, Timeout

from torchstash import env
from torchstash.errors import KernelUnavailable
from torchstash.kernels import buildlock, loader, pack_bits, philox_uniform
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
from filelock import FileLock, Timeout
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


def copy_of_the_sources(tmp_path: Path) -> tuple[Path, Path]:
    """The kernel sources, and a copy of them under ``tmp_path`` to change; skips where there
    are none."""
    root, _ = loader.find_csrc()
    if root is None:
        pytest.skip("no kernel sources")
    copy = tmp_path / "csrc"
    shutil.copytree(root, copy)
    return root, copy


def test_build_failure_is_reported_with_its_cause(tmp_path: Path) -> None:
    """A fresh process (this one may hold the real library already) builds broken sources."""
    _, broken = copy_of_the_sources(tmp_path)
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
    root, copy = copy_of_the_sources(tmp_path)
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


# -- the build lock ---------------------------------------------------------------------------


class FakeCompile:
    """cpp_extension.load's stand-in: notes who holds the lock and whether cpp_extension's own
    baton was there, then fails (nothing compiles)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.build_dir = Path()

    def __call__(self, **kwargs: Any) -> None:
        where = Path(kwargs["build_directory"])
        owner = json.loads((where / buildlock.OWNER_NAME).read_text())
        held = not _free(where / buildlock.LOCK_NAME)
        self.calls.append({"owner": owner["pid"], "held": held, "baton": (where / "lock").exists()})
        raise RuntimeError("simulated compile")

    @property
    def lock(self) -> Path:
        return self.build_dir / buildlock.LOCK_NAME


def _free(path: Path) -> bool:
    """Whether another holder could take the lock now (a second FileLock: its own descriptor)."""
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return False
    lock.release()
    return True


BUILT = {"owner": os.getpid(), "held": True, "baton": False}


@pytest.fixture
def fake_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_loader: None
) -> FakeCompile:
    """A fresh cache whose builds reach a fake cpp_extension.load; its build_dir is known."""
    from torch.utils import cpp_extension

    if loader.find_csrc()[0] is None:
        pytest.skip("no kernel sources")
    monkeypatch.setenv(env.CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setenv(env.KERNELS, "auto")
    monkeypatch.setenv(env.KERNEL_LOCK_WAIT, "5")  # a regression fails, it does not hang
    monkeypatch.setattr(loader, "_guards", lambda reason: [])  # no toolchain needed
    monkeypatch.setattr(loader, "_loaded", None)  # as in a process that has not loaded it
    monkeypatch.setattr(buildlock, "POLL_SECONDS", 0.02)
    fake = FakeCompile()
    monkeypatch.setattr(cpp_extension, "load", fake)
    info = loader.status()
    assert info["reasons"] == ["build failed: simulated compile"], info["reasons"]
    assert fake.calls == [BUILT]
    build_dir = Path(info["build_dir"])
    assert _free(build_dir / buildlock.LOCK_NAME)  # released after the build
    assert not (build_dir / buildlock.OWNER_NAME).exists()
    fake.build_dir, fake.calls = build_dir, []
    loader._reset()
    return fake


HOLD = """
import json, os, socket, sys, time
from filelock import FileLock
lock = FileLock(sys.argv[1]); lock.acquire()
open(sys.argv[2], "w").write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture
def live_holder(fake_compile: FakeCompile) -> Iterator[subprocess.Popen[str]]:
    """Another process of this machine holding the build lock, as a build in progress does."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HOLD,
            str(fake_compile.lock),
            str(fake_compile.build_dir / buildlock.OWNER_NAME),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    with proc.stdout:
        assert proc.stdout.readline().strip() == "held"
        yield proc
        proc.kill()
        proc.wait()


def test_a_killed_build_leaves_nothing_that_blocks_the_next(
    fake_compile: FakeCompile, live_holder: subprocess.Popen[str]
) -> None:
    """A build killed by SIGKILL or the OOM killer releases the lock with its process; what it
    leaves on disk (the lock file, its owner note, cpp_extension's ``lock``, which that would
    poll forever) does not stop the next build, which goes ahead at once."""
    (fake_compile.build_dir / "lock").touch()
    live_holder.kill()
    live_holder.wait()
    assert fake_compile.lock.exists() and (fake_compile.build_dir / buildlock.OWNER_NAME).exists()
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        info = loader.status()
    assert time.monotonic() - start < 3  # not waited on
    assert fake_compile.calls == [BUILT]
    assert info["reasons"] == ["build failed: simulated compile"]
    notes = " | ".join(info["notes"])
    assert f"removed {fake_compile.build_dir / 'lock'}, left by an interrupted build" in notes
    assert "waited" not in notes


def test_a_live_builder_is_waited_on_then_the_reference_is_used(
    fake_compile: FakeCompile,
    live_holder: subprocess.Popen[str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv(env.KERNEL_LOCK_WAIT, "0.4")
    codes = torch.randint(0, 4, (33,), dtype=torch.uint8)
    caplog.set_level(logging.INFO, logger=loader.__name__)
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = pack_bits(codes, 2)
        waited = time.monotonic() - start
        assert torch.equal(pack_bits(codes, 2), got)  # memoized: no second wait, no warning
    assert 0.4 <= waited < 1.4  # the time limit, and not much more
    assert time.monotonic() - start - waited < 0.5
    assert torch.equal(got, pack_bits_ref(codes, 2))
    assert fake_compile.calls == []
    assert not _free(fake_compile.lock)  # a live builder's lock is left alone
    assert len(caplog.records) == 1
    log = caplog.records[0]
    assert log.levelno == logging.WARNING
    assert str(fake_compile.lock) in log.getMessage()
    assert f"pid {live_holder.pid}" in log.getMessage()
    assert [w.category for w in caught] == [RuntimeWarning]
    message = str(caught[0].message)
    assert "using the pure-PyTorch reference" in message
    assert f"pid {live_holder.pid}" in message and "TORCHSTASH_KERNEL_LOCK_WAIT" in message


def test_require_raises_on_a_busy_lock_and_builds_once_it_is_free(
    fake_compile: FakeCompile,
    live_holder: subprocess.Popen[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(env.KERNELS, "require")
    monkeypatch.setenv(env.KERNEL_LOCK_WAIT, "0.2")
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(KernelUnavailable) as busy:
            loader.load()
    assert 0.2 <= time.monotonic() - start < 1.2
    assert f"pid {live_holder.pid}" in str(busy.value) and str(fake_compile.lock) in str(busy.value)
    assert "gave up waiting after 0.2s (TORCHSTASH_KERNEL_LOCK_WAIT)" in str(busy.value)
    assert fake_compile.calls == []
    live_holder.kill()
    live_holder.wait()
    with pytest.raises(KernelUnavailable, match="build failed: simulated compile"):
        loader.load()  # not memoized: the holder is gone, so this call builds
    assert fake_compile.calls == [BUILT]


def test_a_build_that_waited_says_so(
    fake_compile: FakeCompile,
    live_holder: subprocess.Popen[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A builder that finishes while another process waits: that one then builds (here: finds
    the build failed, as the fake compiles nothing) and notes whose build it waited for."""
    monkeypatch.setenv(env.KERNEL_LOCK_WAIT, "30")
    stopper = threading.Timer(0.3, live_holder.kill)
    stopper.start()
    try:
        info = loader.status()
    finally:
        stopper.cancel()
    assert fake_compile.calls == [BUILT]
    assert f"for pid {live_holder.pid} on " in " ".join(info["notes"])


def test_lock_settings_are_checked(
    fake_compile: FakeCompile, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(env.KERNEL_LOCK_WAIT, "soon")
    info = loader.status()
    assert info["reasons"] == [
        "TORCHSTASH_KERNEL_LOCK_WAIT='soon' is not a number of seconds (>= 0); "
        "unset it for the default"
    ]
    assert fake_compile.calls == []
