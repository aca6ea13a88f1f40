"""Just-in-time build and load of the compiled kernels (``csrc/``), memoized per process.

In the style of stylegan3's ``custom_ops`` and DeepSpeed's op builder: the library is
built with ``torch.utils.cpp_extension.load`` into a cache directory keyed by a digest
of the sources, torch, Python and the cpu/cuda variant, so a rebuild happens only
when one of those changes. ``TORCHSTASH_KERNELS`` picks what a failure means:
``auto`` warns once and falls back to the pure-PyTorch reference for the rest of the
process, ``off`` never builds, ``require`` raises :class:`~torchstash.errors.KernelUnavailable`
and forgets the failure (the next call tries again). An exception anywhere in the build
(not only the compiler's) counts as a failed build.

A build holds an OS file lock in its build directory (:mod:`.buildlock`), so processes
sharing a cache build once, and a killed build releases it with its process. Another process
needing the same build waits, with one log record (logger ``torchstash.kernels.loader``,
level WARNING) naming the lock and the builder's pid, for at most
``TORCHSTASH_KERNEL_LOCK_WAIT`` seconds (default :data:`LOCK_WAIT_SECONDS`); then its build
counts as failed. ``cpp_extension.load``'s own ``lock``, an empty file it polls forever, is
removed while holding ours: only an interrupted build (SIGKILL, SIGTERM, the out-of-memory
killer) leaves one behind.
Nothing here prints or touches ``os.environ``, except that one log record while waiting;
``status()`` is for ``torchstash doctor``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shlex
import shutil
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchstash import env
from torchstash.errors import KernelUnavailable

from .buildlock import build_lock

__all__ = ["MODES", "available", "cached", "load", "mode", "require", "status"]

MODES = ("auto", "off", "require")
NAME = "torchstash_kernels"
#: Bump when the build recipe below changes in a way the digest would not see.
#: 2: builds hold a lock (a torchstash without it never shares a build directory).
#: 3: the lock is an OS file lock (buildlock), which the JSON lock of 2 would not see.
RECIPE = "3"
#: Seconds to wait on another process's build before using the reference
#: (``TORCHSTASH_KERNEL_LOCK_WAIT``).
LOCK_WAIT_SECONDS = 600.0
#: What cpp_extension.load's FileBaton creates in the build directory and polls forever.
_BATON_NAME = "lock"
_log = logging.getLogger(__name__)
_SOURCE_SUFFIXES = (".h", ".cuh", ".cpp", ".cu")
_REQUIRED = ("include/torchstash/common.h", "bindings/ops.cpp")
_HERE = Path(__file__).resolve()


@dataclass
class _Outcome:
    """The result of one build attempt (successful or not)."""

    built: bool = False
    variant: str = "cpu"
    csrc_dir: str | None = None
    build_dir: str | None = None
    digest: str | None = None
    library: str | None = None
    build_seconds: float | None = None
    cached: bool | None = None
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    cause: BaseException | None = field(default=None, repr=False)


_lock = threading.RLock()
_outcome: _Outcome | None = None
_warned = False
# The library dlopen()ed into this process, as (digest, path): a process can hold only
# one TORCH_LIBRARY(torchstash), so this survives _reset().
_loaded: tuple[str, str] | None = None


def mode() -> str:
    """The ``TORCHSTASH_KERNELS`` mode; an unknown value is a ``ValueError``."""
    value = env.get(env.KERNELS, "auto").lower() or "auto"
    if value not in MODES:
        raise ValueError(
            f"{env.KERNELS}={value!r} is not valid; use one of {', '.join(MODES)} "
            "(auto: build, fall back with a warning; off: never build; require: fail if unbuilt)"
        )
    return value


def cache_root() -> Path:
    """Where builds go: ``TORCHSTASH_CACHE_DIR`` or ``~/.cache/torchstash/kernels``."""
    configured = env.get(env.CACHE_DIR)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "torchstash" / "kernels"


def _missing_sources(root: Path) -> list[str]:
    missing = [rel for rel in _REQUIRED if not (root / rel).is_file()]
    if not any((root / "cpu").glob("*.cpp")):
        missing.append("cpu/*.cpp")
    return missing


def find_csrc() -> tuple[Path | None, str | None]:
    """(csrc directory, None) or (None, reason).

    Order: ``TORCHSTASH_CSRC_DIR`` (no fallback when set), the copy packaged in the
    wheel (``torchstash/_csrc``), the repository checkout (``<repo>/csrc``, i.e.
    ``parents[5]`` of ``<repo>/packages/core/src/torchstash/kernels/loader.py``).
    """
    configured = env.get(env.CSRC_DIR)
    if configured:
        root = Path(configured).expanduser()
        missing = _missing_sources(root)
        if missing:
            return None, (
                f"{env.CSRC_DIR}={configured} does not hold the kernel sources "
                f"(missing {', '.join(missing)}); point it at torchstash's csrc/ or unset it"
            )
        return root, None
    candidates = [_HERE.parents[1] / "_csrc"]
    if len(_HERE.parents) > 5:
        candidates.append(_HERE.parents[5] / "csrc")
    for root in candidates:
        if not _missing_sources(root):
            return root, None
    return None, (
        "kernel sources not found (looked in "
        + ", ".join(str(c) for c in candidates)
        + f"); reinstall torchstash or set {env.CSRC_DIR}"
    )


def _variant(notes: list[str]) -> str:
    """``cuda`` when a GPU, a CUDA build of torch and a CUDA toolkit are all present."""
    if not torch.cuda.is_available():
        return "cpu"
    from torch.utils import cpp_extension

    if not torch.version.cuda or not cpp_extension.CUDA_HOME:
        notes.append("CUDA kernels skipped: no CUDA toolkit found (set CUDA_HOME)")
        return "cpu"
    if not Path(cpp_extension.CUDA_HOME, "bin", "nvcc").exists():
        notes.append(f"CUDA kernels skipped: no nvcc under CUDA_HOME={cpp_extension.CUDA_HOME}")
        return "cpu"
    return "cuda"


def _sources(root: Path, variant: str) -> list[Path]:
    sources = [*sorted((root / "cpu").glob("*.cpp")), root / "bindings" / "ops.cpp"]
    if variant == "cuda":
        sources += [*sorted((root / "cuda").glob("*.cu")), root / "bindings" / "ops_cuda.cpp"]
    return sources


def _flags() -> tuple[list[str], list[str], list[str]]:
    """(cflags, cuda cflags, ldflags). Apple clang has no -fopenmp: the loops run serially.

    ``-ffp-contract=off``: g++ would otherwise fuse ``lo + code * step`` into an FMA in the
    AVX-512 clones, and group_dequantize must round the product and the sum separately to
    match the reference bit for bit (the CUDA side uses ``__fmul_rn``/``__fadd_rn``).
    """
    openmp = [] if sys.platform == "darwin" else ["-fopenmp"]
    return ["-O3", "-DNDEBUG", "-ffp-contract=off", *openmp], ["-O3", "-DNDEBUG"], openmp


def digest(root: Path, variant: str) -> str:
    """sha256 of every source and header, the flags, torch, Python and the variant."""
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in _SOURCE_SUFFIXES and p.is_file()):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    meta = (
        RECIPE,
        variant,
        torch.__version__,
        str(torch.version.cuda),
        sys.implementation.cache_tag,
        sys.platform,
        repr(_flags()),
        _compiler(),
    )
    h.update("\0".join(meta).encode())
    return h.hexdigest()


def _compiler() -> str:
    """The C++ compiler cpp_extension will run (``$CXX`` or ``c++``)."""
    from torch.utils import cpp_extension

    return str(cpp_extension.get_cxx_compiler())


def _guards(csrc_reason: str | None) -> list[str]:
    """Why a build cannot even start (empty when it can)."""
    from torch.utils import cpp_extension

    reasons = [] if csrc_reason is None else [csrc_reason]
    if os.name == "nt":
        reasons.append("Windows builds are not supported (the kernels use g++/clang flags)")
    if not cpp_extension.is_ninja_available():
        reasons.append("ninja is not installed (pip install ninja)")
    compiler = _compiler()
    if shutil.which((shlex.split(compiler) or [""])[0]) is None:
        reasons.append(f"no C++ compiler: {compiler!r} is not on PATH (install g++ or set CXX)")
    cache = cache_root()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        writable = os.access(cache, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        reasons.append(f"cache directory {cache} is not writable; set {env.CACHE_DIR}")
    return reasons


def _lock_wait() -> float:
    """Seconds to wait on another process's build (``TORCHSTASH_KERNEL_LOCK_WAIT``)."""
    raw = env.get(env.KERNEL_LOCK_WAIT)
    if not raw:
        return LOCK_WAIT_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(
            f"{env.KERNEL_LOCK_WAIT}={raw!r} is not a number of seconds (>= 0); unset it for "
            "the default"
        )
    return value


def _remove_baton(build_dir: Path, notes: list[str]) -> None:
    """Removes cpp_extension's ``lock``: under our lock, only an interrupted build left it."""
    baton = build_dir / _BATON_NAME
    try:
        baton.unlink()
    except FileNotFoundError:
        return
    notes.append(f"removed {baton}, left by an interrupted build")


def _compile(build_dir: Path, name: str, root: Path, out: _Outcome) -> None:
    """Builds (or loads from the cache) the library, holding the build lock."""
    from torch.utils import cpp_extension

    _remove_baton(build_dir, out.notes)
    cflags, cuda_cflags, ldflags = _flags()
    out.cached = any(build_dir.glob(f"{name}*.so"))
    if not out.cached:  # the one slow first use: say so (logger torchstash.kernels.loader)
        _log.warning(
            "torchstash: building the compiled %s kernels into %s (first use of these "
            "sources: up to a few minutes; cached after; `torchstash build` does it ahead)",
            out.variant, build_dir,
        )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpp_extension.load(
            name=name,
            sources=[str(s) for s in _sources(root, out.variant)],
            extra_cflags=cflags,
            extra_cuda_cflags=cuda_cflags,
            extra_ldflags=ldflags,
            extra_include_paths=[str(root / "include")],
            build_directory=str(build_dir),
            with_cuda=out.variant == "cuda",
            is_python_module=False,
            verbose=False,
        )
    out.notes += [f"build warning: {w.message}" for w in caught]


def _build() -> _Outcome:
    global _loaded
    out = _Outcome()
    root, csrc_reason = find_csrc()
    out.csrc_dir = None if root is None else str(root)
    out.variant = _variant(out.notes)
    out.reasons = _guards(csrc_reason)
    if out.reasons or root is None:
        return out
    out.digest = digest(root, out.variant)
    build_dir = cache_root() / f"{out.variant}-{out.digest[:16]}"
    out.build_dir = str(build_dir)
    # The digest in the name keeps cpp_extension's per-name versioning (which would
    # rename the library to *_v1) out of the way when a process tries other sources.
    name = f"{NAME}_{out.digest[:12]}"
    if _loaded is not None:
        if _loaded[0] != out.digest:
            out.reasons.append(
                f"a different torchstash kernel library is already loaded ({_loaded[1]}); "
                "restart Python to load the new one"
            )
            return out
        out.built, out.library, out.cached, out.build_seconds = True, _loaded[1], True, 0.0
        return out
    try:
        wait = _lock_wait()
    except ValueError as exc:
        out.reasons.append(str(exc))
        return out
    start = time.perf_counter()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with build_lock(build_dir, wait, out.notes) as busy:
            if busy is not None:
                out.reasons.append(busy)
                return out
            start = time.perf_counter()  # the build's time, not the wait's
            _compile(build_dir, name, root, out)
    except Exception as exc:  # compiler errors, linker errors, dlopen failures, ...
        out.build_seconds = time.perf_counter() - start
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        out.reasons.append(f"build failed: {first_line}")
        out.error = f"{type(exc).__name__}: {exc}"
        out.cause = exc
        return out
    out.build_seconds = time.perf_counter() - start
    library = max(build_dir.glob(f"{name}*.so"), key=lambda p: p.stat().st_mtime, default=None)
    out.built, out.library = True, str(library)
    _loaded = (out.digest, str(library))
    from . import _meta

    _meta.register()
    return out


def _ensure_built() -> _Outcome:
    global _outcome
    with _lock:
        if _outcome is None:
            try:
                _outcome = _build()
            except Exception as exc:  # outside cpp_extension.load: hashing, guards, registering
                # A failure anywhere in the build is a failed build, not a crash of the caller
                # (a compressor in the middle of a forward pass): auto falls back, require raises.
                first_line = (str(exc).strip().splitlines() or [""])[0]
                _outcome = _Outcome(
                    reasons=[f"build failed: {type(exc).__name__}: {first_line}".rstrip(": ")],
                    error=f"{type(exc).__name__}: {exc}",
                    cause=exc,
                )
        return _outcome


def _forget_failure() -> None:
    """Under ``require`` a failure raises instead of being memoized: the caller may fix the
    cause (a cache directory, a compiler) and retry in the same process."""
    global _outcome
    with _lock:
        if _outcome is not None and not _outcome.built:
            _outcome = None


_REQUIRE_ADVICE = (
    f"Run `torchstash doctor` for details, fix the cause and retry (a failure under "
    f"{env.KERNELS}=require is not memoized), or unset {env.KERNELS} to fall back to the "
    "pure-PyTorch reference with a warning"
)


def _message(reasons: list[str]) -> str:
    return "; ".join(reasons) or "unknown reason"


def load() -> bool:
    """Builds/loads the kernels once per process; True when they can be used.

    ``auto``: a failure warns once (RuntimeWarning) and returns False. ``off``: False
    without building. ``require``: a failure raises KernelUnavailable.
    """
    global _warned
    current = mode()
    if current == "off":
        return False
    outcome = _ensure_built()
    if outcome.built:
        return True
    if current == "require":
        _forget_failure()
        raise KernelUnavailable(
            f"compiled kernels required ({env.KERNELS}=require) but unavailable: "
            f"{_message(outcome.reasons)}. {_REQUIRE_ADVICE}"
        ) from outcome.cause
    with _lock:
        if not _warned:
            _warned = True
            warnings.warn(
                f"torchstash: compiled kernels unavailable ({_message(outcome.reasons)}); "
                "using the pure-PyTorch reference. Run `torchstash doctor` for details, "
                f"or set {env.KERNELS}=off to skip the build",
                RuntimeWarning,
                stacklevel=2,
            )
    return False


def _device_reason(device: torch.device | str) -> str | None:
    """Why built kernels cannot serve ``device`` (None when they can)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return None
    if dev.type == "cuda":
        outcome = _ensure_built()
        if outcome.variant == "cuda":
            return None
        return "the kernels were built without CUDA" + (
            f" ({_message(outcome.notes)})" if outcome.notes else ""
        )
    return f"no compiled kernels for device type {dev.type!r} (only cpu and cuda)"


def available(device: torch.device | str = "cpu") -> bool:
    """Whether the compiled kernels can run on ``device`` (builds them on first use)."""
    return load() and _device_reason(device) is None


def require(device: torch.device | str = "cpu") -> None:
    """Raises KernelUnavailable, naming the reasons, unless the kernels can run on ``device``."""
    if mode() == "off":
        raise KernelUnavailable(
            f"compiled kernels requested but {env.KERNELS}=off; unset it or use impl='ref'"
        )
    outcome = _ensure_built()
    if not outcome.built:
        if mode() == "require":
            _forget_failure()
            advice = _REQUIRE_ADVICE
        else:
            advice = "Run `torchstash doctor` for details, or use impl='ref'"
        raise KernelUnavailable(
            f"compiled kernels unavailable: {_message(outcome.reasons)}. {advice}"
        ) from outcome.cause
    reason = _device_reason(device)
    if reason is not None:
        raise KernelUnavailable(f"compiled kernels unavailable on {device}: {reason}")


def cached() -> bool:
    """Whether a build of the current sources is in the cache already (loading it is quick)."""
    root, _ = find_csrc()
    if root is None:
        return False
    variant = _variant([])
    key = digest(root, variant)
    return any((cache_root() / f"{variant}-{key[:16]}").glob(f"{NAME}_{key[:12]}*.so"))


def status(*, build: bool = True) -> dict[str, Any]:
    """What ``torchstash doctor`` prints: mode, built, variant, build dir, digest, timings, reasons.

    With ``build=True`` (and mode not ``off``) a first build is attempted, without warning.
    """
    mode_error: str | None = None
    try:
        current = mode()
    except ValueError as exc:
        current, mode_error = "invalid", str(exc)
    if build and current in ("auto", "require"):
        _ensure_built()
    with _lock:
        outcome = _outcome if _outcome is not None else _Outcome()
        info = asdict(outcome)
    info.pop("cause")
    info["mode"] = current
    info["attempted"] = _outcome is not None
    info["cache_root"] = str(cache_root())
    if mode_error is not None:
        info["reasons"] = [mode_error, *info["reasons"]]
    elif current == "off":
        info["reasons"] = [f"{env.KERNELS}=off", *info["reasons"]]
    return info


def _reset() -> None:
    """Forget the memoized outcome and the warn-once flag (for tests).

    The library already dlopen()ed into this process stays loaded.
    """
    global _outcome, _warned
    with _lock:
        _outcome = None
        _warned = False
