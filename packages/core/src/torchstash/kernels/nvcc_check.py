"""Compile-only check of the CUDA sources, for CI machines without a GPU or CUDA torch.

The ``.cu`` files use no torch headers, so ``nvcc -c`` alone catches their errors.
``python -m torchstash.kernels.nvcc_check [CSRC_DIR]`` exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .loader import find_csrc

__all__ = ["main", "nvcc_check"]


def nvcc_check(
    csrc_dir: str | Path | None = None, *, std: str = "c++17", timeout: float = 300.0
) -> list[tuple[Path, bool, str]]:
    """Runs ``nvcc -c`` on every ``csrc/cuda/*.cu``: ``[(path, ok, compiler output), ...]``.

    Returns ``[]`` when nvcc is not on PATH; raises FileNotFoundError without sources.
    """
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return []
    if csrc_dir is None:
        found, reason = find_csrc()
        if found is None:
            raise FileNotFoundError(reason)
        root = found
    else:
        root = Path(csrc_dir)
    results: list[tuple[Path, bool, str]] = []
    with tempfile.TemporaryDirectory(prefix="torchstash-nvcc-") as tmp:
        for source in sorted((root / "cuda").glob("*.cu")):
            cmd = [
                nvcc,
                "-c",
                f"-std={std}",
                "-I",
                str(root / "include"),
                str(source),
                "-o",
                str(Path(tmp) / f"{source.stem}.o"),
            ]
            try:
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=timeout, check=False
                )
            except subprocess.TimeoutExpired as exc:
                results.append((source, False, f"timed out after {timeout}s: {exc}"))
                continue
            results.append((source, proc.returncode == 0, (proc.stdout + proc.stderr).strip()))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchstash.kernels.nvcc_check", description=__doc__
    )
    parser.add_argument("csrc_dir", nargs="?", default=None, help="default: the loader's csrc/")
    args = parser.parse_args(argv)
    if shutil.which("nvcc") is None:
        print("nvcc not on PATH: nothing checked")
        return 0
    results = nvcc_check(args.csrc_dir)
    for path, ok, output in results:
        print(f"{'ok  ' if ok else 'FAIL'} {path}")
        if output:
            print(output)
    if not results:
        print("no .cu files found")
        return 1
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
