"""How much memory the machine can still give, checked before a large allocation.

A size typed by an operator (GPU slots, requests to generate) can be far
beyond the machine; asking first turns an out-of-memory crash, or a machine
that swaps to a halt, into one clear error. Torch-free, for the simulator.

In a container the limit is usually the control group's, not the host's:
``MemAvailable`` then shows the whole host, and an allocation it allows ends in
the kernel's out-of-memory kill, with no message. So the least of the two counts.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from kvoffload.core.errors import InsufficientMemoryError

PROC_SELF_CGROUP = Path("/proc/self/cgroup")
"""Which control group this process is in, one line per hierarchy."""
CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where the control group file systems are mounted (v2 here, v1 under ``memory/``)."""
NO_LIMIT = 2**60
"""cgroup v1 writes "no limit" as the largest page-aligned 64-bit number; anything from here
on is no limit (v2 writes ``max``)."""


def available_bytes() -> int | None:
    """Memory available to new allocations: the least of the machine's (``MemAvailable``)
    and what this process's control group still allows; ``None`` if neither is known."""
    known = [value for value in (_machine_available(), _cgroup_available()) if value is not None]
    return min(known, default=None)


def _machine_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _cgroup_available() -> int | None:
    """The least room under the memory limit of this process's control group or any group
    above it (each limit holds), counting reclaimable file cache as room; ``None`` where
    no group sets one or the files cannot be read."""
    try:
        lines = PROC_SELF_CGROUP.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    rooms: list[int] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2: one hierarchy for every controller
            rooms += _rooms(CGROUP_ROOT, path, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            rooms += _rooms(
                CGROUP_ROOT / "memory",
                path,
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "total_inactive_file",
            )
    return min(rooms, default=None)


def _rooms(mount: Path, path: str, limit_file: str, usage_file: str, cache_key: str) -> list[int]:
    """The room under each limit from the group at ``path`` up to ``mount``. Inside a
    container the mount is often the group itself while ``path`` names it as the host
    does: then the group is the mount's top."""
    group = mount / path.lstrip("/")
    if not group.is_dir():
        group = mount
    rooms = []
    while True:
        room = _room(group, limit_file, usage_file, cache_key)
        if room is not None:
            rooms.append(room)
        if group == mount or mount not in group.parents:
            return rooms
        group = group.parent


def _room(group: Path, limit_file: str, usage_file: str, cache_key: str) -> int | None:
    try:
        limit_text = (group / limit_file).read_text(encoding="ascii").strip()
        if limit_text == "max" or int(limit_text) >= NO_LIMIT:
            return None
        used = int((group / usage_file).read_text(encoding="ascii"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return max(0, int(limit_text) - max(0, used - _stat(group, cache_key)))


def _stat(group: Path, key: str) -> int:
    """One counter of the group's ``memory.stat`` (0 if missing)."""
    try:
        for line in (group / "memory.stat").read_text(encoding="ascii").splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError, UnicodeDecodeError):
        pass
    return 0


def check_fits(num_bytes: float, what: str) -> None:
    """:class:`InsufficientMemoryError` if ``num_bytes`` for ``what`` exceed available memory."""
    available = available_bytes()
    if available is not None and num_bytes > available:
        raise InsufficientMemoryError(
            f"{what} would need {_memory(num_bytes)}, "
            f"more than the {available / 2**30:,.1f} GiB available"
        )


def _memory(num_bytes: float) -> str:
    """``num_bytes`` as a figure a reader takes in: past a million GiB, a row of digits
    only says "huge", and ``inf`` (a size past the float range) says nothing."""
    gib = num_bytes / 2**30
    if gib < 1e6:
        return f"about {gib:,.1f} GiB of memory"
    if math.isfinite(gib):
        return f"about {gib:.3g} GiB of memory"
    return "more memory than a float can count"
