"""A host program built against the kernels' headers (``csrc/include``) and run: how tests
hold the functions the CUDA kernels run (``groupquant.h``, ``channelquant.h``, ``sparse.h``)
to their pure-PyTorch reference on a machine without a GPU."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from ..kernels import loader


def build_host_program(source: str, where: Path, *, loader_flags: bool = True) -> Path:
    """``source`` compiled (C++17, warnings as errors) into ``where/prog``: with the loader's
    flags and FMA where the compiler can target it (what the kernels are built with), or plain
    ``-O2``. Skips the calling test where there are no kernel sources or no C++ compiler."""
    root, reason = loader.find_csrc()
    if root is None:
        pytest.skip(str(reason))
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    assert root is not None and cxx is not None  # pytest.skip raised otherwise
    (where / "prog.cpp").write_text(source)
    if loader_flags:
        fma = ["-mfma"] if platform.machine() in ("x86_64", "AMD64") else []
        flags = ["-O3", *loader._flags()[0], *fma]
    else:
        flags = ["-O2"]
    build = subprocess.run(
        [cxx, "-std=c++17", "-Wall", "-Wextra", "-Werror", *flags, "-I", str(root / "include"),
         str(where / "prog.cpp"), "-o", str(where / "prog")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    return where / "prog"


def run_host_program(program: Path, *args: str, timeout: float = 60) -> None:
    """Runs ``program`` with ``args``; a failure shows its standard error."""
    run = subprocess.run(
        [str(program), *args], capture_output=True, text=True, check=False, timeout=timeout
    )
    assert run.returncode == 0, run.stderr
