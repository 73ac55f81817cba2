"""A worker's CPU block buffer as a file in shared memory, so the scheduler process can map it.

Under vLLM the workers own the CPU slots and the scheduler process owns the
tier stack that writes slots down to disk or a server and reads them back.
With lower tiers each worker rank keeps its slots in one file,
``<directory>/kvoffload-<launch>-r<rank>.kv`` (``directory`` is ``/dev/shm``
where it exists), that both processes map.

Life cycle. The worker creates the file exclusively and holds an exclusive
``flock`` on it for as long as it lives; the kernel drops that lock however
the process ends. So a file whose lock nobody holds belongs to no live
launch: the scheduler never maps one (see :func:`map_live_region`), a
worker that finds one under its own name replaces it, and every worker
removes such files left by crashed launches when it starts
(:func:`sweep_stale_regions`). The creator unlinks its file on shutdown.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import re
import stat
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvoffload.core.errors import InsufficientMemoryError, InvalidArgumentError
from kvoffload.dataplane.pinning import register, unregister, wants_pinning

logger = logging.getLogger(__name__)

PREFIX = "kvoffload-"
SUFFIX = ".kv"
STALE_AFTER_S = 60.0
"""A lock-free region file younger than this may be one a live worker is still creating."""


def default_directory() -> Path:
    """``/dev/shm`` (memory-backed) where it exists, else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def region_path(directory: Path, launch: str, rank: int) -> Path:
    """The file of ``rank``'s buffer in ``launch``: readable, and distinct per launch id."""
    if not launch:
        raise InvalidArgumentError("a shared region needs a non-empty launch id")
    if rank < 0:
        raise InvalidArgumentError(f"rank must be >= 0, got {rank}")
    readable = re.sub(r"[^A-Za-z0-9_.-]", "_", launch)[:64]
    digest = hashlib.blake2b(launch.encode(), digest_size=4).hexdigest()
    return directory / f"{PREFIX}{readable}-{digest}-r{rank}{SUFFIX}"


def _locked_elsewhere(fd: int) -> bool:
    """Whether another open file holds an exclusive lock on ``fd``'s file (a live owner)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return True
        raise
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


LOCK_WAIT_S = 0.5
"""How long a new file's exclusive lock waits out another process's look at it."""


def _lock_fresh(fd: int) -> None:
    """Lock a file just created here, exclusively. Between its creation and this lock a
    scheduler asking whether a live launch owns it (:func:`_locked_elsewhere`) may hold a
    shared lock for an instant: wait that out, briefly, rather than fail the start."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as exc:
            busy = exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
            if not busy or time.monotonic() >= deadline:
                raise
        time.sleep(0.001)


def _open_regular(path: Path) -> int:
    """``path`` opened read-only, never following a symlink nor waiting on a FIFO (whose
    open would block until a writer came); an :class:`OSError` unless it is a regular
    file, as every region file is (a symlink, FIFO or directory there is none of ours)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "a symbolic link") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    return fd


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def sweep_stale_regions(directory: Path, older_than_s: float = STALE_AFTER_S) -> list[Path]:
    """Remove region files no live process holds, older than ``older_than_s``; the removed."""
    removed: list[Path] = []
    now = time.time()
    for path in directory.glob(f"{PREFIX}*{SUFFIX}"):
        try:
            if now - path.lstat().st_mtime < older_than_s:
                continue
            fd = _open_regular(path)
        except OSError:
            continue  # gone already, or not a file a worker made
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same_file(fd, path):
                path.unlink()
                removed.append(path)
        except OSError:
            continue  # held by a live worker, or gone already
        finally:
            os.close(fd)
    if removed:
        logger.info(
            "kvoffload: removed %d stale shared KV buffer(s) in %s", len(removed), directory
        )
    return removed


def map_live_region(path: Path, size: int) -> mmap.mmap:
    """``path`` mapped read-write, if a live worker holds it and it has ``size`` bytes.

    :class:`FileNotFoundError` while the worker has not created it yet;
    :class:`InvalidArgumentError` for a file of a dead launch or of another size.
    """
    fd = os.open(path, os.O_RDWR)
    try:
        if not _locked_elsewhere(fd):
            raise InvalidArgumentError(f"{path} is held by no live worker (a crashed launch?)")
        actual = os.fstat(fd).st_size
        if actual != size:
            raise InvalidArgumentError(f"{path} has {actual} bytes, expected {size}")
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


class SharedRegion:
    """One worker's buffer of ``size`` bytes in a shared file it creates, locks and unlinks.

    ``tensor`` is the whole buffer as ``uint8``. With ``pin`` (default: when
    CUDA is available) it is registered with CUDA as pinned memory, so copies
    to and from the GPU run asynchronously; if registration fails the copies
    stay correct, only slower.
    """

    def __init__(self, path: Path, size: int, pin: bool | None = None) -> None:
        if size < 1:
            raise InvalidArgumentError(f"a shared region needs >= 1 byte, got {size}")
        pin = wants_pinning(pin, "pin")
        self.path = path
        self.size = size
        sweep_stale_regions(path.parent)
        self._fd = self._create(path)
        try:
            # Reserved up front: a short /dev/shm fails here, not later with SIGBUS in a copy.
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self._fd, 0, size)
            else:
                os.ftruncate(self._fd, size)
            mapping = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED)
        except OSError as exc:
            self._unlink()
            os.close(self._fd)
            raise InsufficientMemoryError(
                f"cannot create the shared KV buffer {path} of {size / 2**30:.2f} GiB: {exc}; "
                f"make {path.parent} larger (e.g. docker --shm-size) or lower cpu_bytes_to_use"
            ) from None
        self._map: mmap.mmap | None = mapping
        # Through NumPy, which holds the mapping's buffer (torch.frombuffer holds none): while
        # any tensor over it lives (the CPU store, the handlers), close cannot unmap it.
        self.tensor: torch.Tensor | None = torch.from_numpy(np.frombuffer(mapping, np.uint8))
        self._pinned = register(self.tensor, str(path)) if pin else 0

    @property
    def pinned(self) -> bool:
        return self._pinned != 0

    def _create(self, path: Path) -> int:
        """Create ``path`` exclusively and lock it, replacing a dead launch's file."""
        for _ in range(3):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except FileExistsError:
                self._replace_stale(path)
                continue
            try:
                _lock_fresh(fd)
            except OSError as exc:  # only a sweeper that misjudged the file's age
                self._unlink_created(path, fd)
                raise InvalidArgumentError(
                    f"cannot lock the shared KV buffer {path}: {exc}"
                ) from None
            return fd
        raise InvalidArgumentError(f"cannot create the shared KV buffer {path}: it keeps existing")

    @staticmethod
    def _unlink_created(path: Path, fd: int) -> None:
        """Remove the file this launch just created (not one that replaced it), and close it."""
        try:
            if _same_file(fd, path):
                path.unlink()
        finally:
            os.close(fd)

    @staticmethod
    def _replace_stale(path: Path) -> None:
        try:
            fd = _open_regular(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise InvalidArgumentError(
                f"cannot replace {path}, in the way of this launch's shared KV buffer: "
                f"{exc.strerror}; remove it or give this vLLM instance another engine_id"
            ) from None
        try:
            if _locked_elsewhere(fd):
                raise InvalidArgumentError(
                    f"the shared KV buffer {path} belongs to a running launch with the same "
                    "engine id and rank; give each vLLM instance its own engine_id"
                )
            if _same_file(fd, path):
                path.unlink()
                logger.warning("kvoffload: replaced a crashed launch's KV buffer %s", path)
        except FileNotFoundError:
            pass  # removed meanwhile: the next exclusive create takes the name
        except OSError as exc:
            raise InvalidArgumentError(
                f"cannot replace the crashed launch's KV buffer {path}: {exc.strerror}; "
                "remove it or give this vLLM instance another engine_id"
            ) from None
        finally:
            os.close(fd)

    def _unlink(self) -> None:
        if _same_file(self._fd, self.path):
            self.path.unlink()

    def close(self) -> None:
        """Unpin, unlink and unmap, or leave the unmapping to the last tensor still viewing
        the buffer (a store's, a handler's); the scheduler's mapping stays valid until it
        closes."""
        if self.tensor is None:
            return
        unregister(self._pinned)
        self._pinned = 0
        self.tensor = None
        self._unlink()
        os.close(self._fd)
        mapping, self._map = self._map, None
        if mapping is not None:
            with contextlib.suppress(BufferError):  # views still alive: unmapped when they go
                mapping.close()
