"""How many CPUs this process may run on: the bound for worker processes and threads.

``taskset`` or a container's cpuset can give a process fewer CPUs than the machine has;
more workers or threads than that only share them, each worker with its own copy of
what it works on, and a thread count in the thousands exhausts the process's threads.
"""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1
