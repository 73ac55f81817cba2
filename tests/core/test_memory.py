"""Available memory counts a container's control group limit, not only the host's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvoffload.core import memory
from kvoffload.core.errors import InsufficientMemoryError

GIB = 2**30
HOST = 64 * GIB
"""The host's free memory in these tests: fixed, as the real figure moves between reads."""


def _cgroups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, membership: str) -> Path:
    """A control group file system under ``tmp_path``, and ``membership`` as this process's
    ``/proc/self/cgroup``, on a host with :data:`HOST` bytes free."""
    root = tmp_path / "cgroup"
    root.mkdir()
    self_cgroup = tmp_path / "self_cgroup"
    self_cgroup.write_text(membership)
    monkeypatch.setattr(memory, "CGROUP_ROOT", root, raising=False)
    monkeypatch.setattr(memory, "PROC_SELF_CGROUP", self_cgroup, raising=False)
    monkeypatch.setattr(memory, "_machine_available", lambda: HOST, raising=False)
    return root


def _group(directory: Path, files: dict[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)


def test_a_v2_limit_below_the_host_is_what_is_available(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel would kill the process past its group's memory.max, however much the host
    has free: the room under the limit is what a check must allow (file cache counts as
    room, the kernel reclaims it first)."""
    root = _cgroups(tmp_path, monkeypatch, "0::/job\n")
    _group(
        root / "job",
        {"memory.max": f"{GIB}\n", "memory.current": f"{GIB // 2}\n"},
    )
    (root / "job" / "memory.stat").write_text(f"anon 1\ninactive_file {GIB // 4}\n")
    assert memory.available_bytes() == GIB * 3 // 4
    with pytest.raises(InsufficientMemoryError, match=r"more than the 0\.8 GiB available"):
        memory.check_fits(GIB, "a GPU prefix cache of 1 blocks")


def test_a_parent_groups_limit_holds_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _cgroups(tmp_path, monkeypatch, "0::/pod/job\n")
    _group(root / "pod", {"memory.max": f"{GIB}\n", "memory.current": f"{GIB // 4}\n"})
    _group(root / "pod" / "job", {"memory.max": "max\n", "memory.current": f"{GIB // 4}\n"})
    assert memory.available_bytes() == GIB * 3 // 4


def test_a_v1_limit_is_read_at_the_mount_when_the_path_is_the_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a container the v1 mount is the container's own group, named by the host's path."""
    root = _cgroups(tmp_path, monkeypatch, "9:pids:/\n4:memory:/docker/abc\n0::/\n")
    _group(
        root / "memory",
        {"memory.limit_in_bytes": f"{GIB}\n", "memory.usage_in_bytes": f"{GIB // 2}\n"},
    )
    (root / "memory" / "memory.stat").write_text(f"cache 9\ntotal_inactive_file {GIB // 4}\n")
    assert memory.available_bytes() == GIB * 3 // 4


@pytest.mark.parametrize(
    ("membership", "files"),
    [
        ("4:memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712\n"}),
        ("0::/job\n", {"job/memory.max": "max\n", "job/memory.current": "5\n"}),
        ("0::/job\n", {"job/memory.max": "junk\n", "job/memory.current": "5\n"}),
        ("0::/job\n", {"job/memory.max": f"{GIB}\n"}),  # no usage to subtract
        ("garbage\n", {}),
        ("0::/\n", {}),  # the host's root group: no memory.max
    ],
)
def test_no_limit_or_unreadable_files_leave_the_hosts_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, membership: str, files: dict[str, str]
) -> None:
    root = _cgroups(tmp_path, monkeypatch, membership)
    for name, text in files.items():
        _group((root / name).parent, {(root / name).name: text})
    assert memory.available_bytes() == HOST


def test_no_cgroup_file_leaves_the_hosts_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _cgroups(tmp_path, monkeypatch, "")
    monkeypatch.setattr(memory, "PROC_SELF_CGROUP", tmp_path / "missing")
    assert memory.available_bytes() == HOST


@pytest.mark.parametrize(
    ("num_bytes", "figure"),
    [
        (1.5 * GIB, "about 1.5 GiB of memory"),
        (2.0**100, "about 1.18e+21 GiB of memory"),
        (float("inf"), "more memory than a float can count"),
    ],
)
def test_a_size_past_memory_is_a_figure_a_reader_takes_in(
    monkeypatch: pytest.MonkeyPatch, num_bytes: float, figure: str
) -> None:
    """A huge size was a row of 22 digits, and one past the float range "about inf GiB"."""
    monkeypatch.setattr(memory, "available_bytes", lambda: GIB)
    with pytest.raises(InsufficientMemoryError, match=f"would need {re.escape(figure)}, more"):
        memory.check_fits(num_bytes, "a cache")
