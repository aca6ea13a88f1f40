"""One kernel build per build directory, across the processes (and machines) sharing a cache.

The lock is an operating-system file lock (``filelock.FileLock``: ``flock`` on POSIX) on
``torchstash.lock`` in the build directory: a build killed in any way (SIGKILL, the
out-of-memory killer, a reboot) releases it with its process, so no lock is ever stale and
none needs deleting. Beside it the holder writes who it is (``torchstash.owner``: pid and
host), for the message of a process that waits on it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from torchstash import env

#: The lock file a build holds in its build directory.
LOCK_NAME = "torchstash.lock"
#: Who holds it (JSON: pid, host), written once it is held.
OWNER_NAME = "torchstash.owner"
#: How often a waiting process tries the lock again, in seconds.
POLL_SECONDS = 0.5
_log = logging.getLogger("torchstash.kernels.loader")


def holder(build_dir: Path) -> str:
    """The process holding the lock of ``build_dir``, as its owner file names it."""
    try:
        owner = json.loads((build_dir / OWNER_NAME).read_text())
        return f"pid {int(owner['pid'])} on {owner['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"  # between taking the lock and writing its name


@contextlib.contextmanager
def build_lock(build_dir: Path, wait: float, notes: list[str]) -> Iterator[str | None]:
    """Holds the build lock of ``build_dir`` for the block, which gets None; or, when another
    process held it for ``wait`` seconds, why not (the block then runs without it). A wait
    is logged once (logger ``torchstash.kernels.loader``, WARNING) and noted in ``notes``."""
    path = build_dir / LOCK_NAME
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        who = holder(build_dir)
        _log.warning(
            "torchstash: %s is building the kernels (lock %s); waiting up to %gs (%s) for it "
            "to finish",
            who, path, wait, env.KERNEL_LOCK_WAIT,
        )  # fmt: skip
        start = time.monotonic()
        try:
            lock.acquire(timeout=wait, poll_interval=min(POLL_SECONDS, max(wait, 0.01)))
        except Timeout:
            yield (
                f"another process is building the kernels: {who} holds the lock {path}, and "
                f"this one gave up waiting after {wait:g}s ({env.KERNEL_LOCK_WAIT})"
            )
            return
        notes.append(f"waited {time.monotonic() - start:.0f}s for {who}'s build")
    owner = build_dir / OWNER_NAME
    try:
        owner.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        yield None
    finally:
        owner.unlink(missing_ok=True)
        lock.release()
