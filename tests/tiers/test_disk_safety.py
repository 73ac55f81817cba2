"""The disk tier never touches what is not its own: links, other users' files, other processes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvoffload import block_id_key
from kvoffload.cli.main import main
from kvoffload.core.layout import layout_preset
from kvoffload.tiers import DiskTier, layout_fingerprint
from kvoffload.tiers.slot_file import DiskTierError

FP = layout_fingerprint("disk-safety", layout_preset("tiny"), 64)
KEYS = [block_id_key(i) for i in range(6)]
SIMULATE = ["simulate", "--requests", "20", "--gpu-blocks", "1500", "--cpu-blocks", "100"]
SIMULATE += ["--layout", "tiny", "--no-bound", "--no-progress", "--disk-blocks", "500"]
PRECIOUS = b"root:x:0:0:root:/root:/bin/bash\n"
OTHER_UID = 65534  # nobody

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def modes_bind() -> bool:
    """Whether a file's mode binds this process: not for root, whose CAP_DAC_OVERRIDE
    opens a file of mode 0400 for writing all the same (a root without it: they do)."""
    with tempfile.TemporaryDirectory() as scratch:
        probe = Path(scratch) / "probe"
        probe.touch(0o400)
        try:
            probe.open("r+b").close()
        except PermissionError:
            return True
    return False


needs_binding_modes = pytest.mark.skipif(not modes_bind(), reason="root ignores file modes")


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.fixture
def fingerprint_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """The directory name ``simulate`` uses under ``--disk-dir``: predictable, as an attacker
    would find by running it once."""
    scratch = tmp_path / "scratch"
    assert main([*SIMULATE, "--disk-dir", str(scratch)]) == 0
    capsys.readouterr()
    [name] = [p.name for p in scratch.iterdir()]
    return name


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "passwd"
    path.write_bytes(PRECIOUS)
    return path


def test_a_symlink_planted_as_the_slot_file_is_refused_and_its_target_untouched(
    tmp_path: Path, fingerprint_dir: str, victim: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "disk"
    (root / fingerprint_dir).mkdir(parents=True)
    (root / fingerprint_dir / "blocks.kvs").symlink_to(victim)
    assert main([*SIMULATE, "--disk-dir", str(root)]) != 0
    assert "symbolic link" in one_line_error(capsys)
    assert victim.read_bytes() == PRECIOUS


@pytest.mark.parametrize("planted", ["directory", "lock", "disk-dir"])
def test_no_other_planted_link_is_followed(
    tmp_path: Path,
    fingerprint_dir: str,
    victim: Path,
    planted: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, elsewhere = tmp_path / "disk", tmp_path / "elsewhere"
    elsewhere.mkdir()
    if planted == "directory":
        root.mkdir()
        (root / fingerprint_dir).symlink_to(elsewhere, target_is_directory=True)
    elif planted == "lock":
        (root / fingerprint_dir).mkdir(parents=True)
        (root / fingerprint_dir / "lock").symlink_to(victim)
    else:
        root.symlink_to(elsewhere, target_is_directory=True)
    assert main([*SIMULATE, "--disk-dir", str(root)]) != 0
    assert "symbolic link" in one_line_error(capsys)
    assert victim.read_bytes() == PRECIOUS and list(elsewhere.iterdir()) == []


def test_a_hard_link_to_another_file_is_refused(
    tmp_path: Path, victim: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "disk" / FP.hex()).mkdir(parents=True)
    os.link(victim, tmp_path / "disk" / FP.hex() / "blocks.kvs")
    with pytest.raises(DiskTierError, match="2 hard links"):
        DiskTier(tmp_path / "disk", 4, FP)
    assert victim.read_bytes() == PRECIOUS


@pytest.mark.parametrize("name", ["blocks.kvs", "lock"])
@pytest.mark.parametrize("kind", ["fifo", "directory", "socket"])
def test_what_is_not_a_regular_file_is_refused_naming_it(
    tmp_path: Path, name: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory or socket fails ``open`` itself (EISDIR, ENXIO): still the file's name.

    The socket is bound by its name from its folder: the whole path can pass the 107 bytes
    an AF_UNIX address holds (a pytest-xdist worker's temporary folder is longer)."""
    path = tmp_path / FP.hex() / name
    path.parent.mkdir()
    with contextlib.ExitStack() as cleanup:
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "directory":
            path.mkdir()
        else:
            listener = cleanup.enter_context(socket.socket(socket.AF_UNIX))
            monkeypatch.chdir(path.parent)
            listener.bind(name)
        with pytest.raises(DiskTierError, match=f"{re.escape(str(path))} is not a regular file"):
            DiskTier(tmp_path, 4, FP)


@needs_root
@pytest.mark.parametrize("owned", ["slot file", "directory", "disk-dir"])
def test_what_another_user_owns_is_refused(tmp_path: Path, owned: str) -> None:
    """The slot file is compared once given back: a root without CAP_DAC_OVERRIDE may not
    read it, or pass through a directory, while another user owns them (mode 0600, 0700)."""
    first = DiskTier(tmp_path / "disk", 4, FP)
    first.write(KEYS[:2], [bytes(64)] * 2)
    first.close()
    path = {
        "slot file": first.path,
        "directory": first.directory,
        "disk-dir": tmp_path / "disk",
    }[owned]
    before = first.path.read_bytes()
    mode = path.stat().st_mode
    os.chown(path, OTHER_UID, OTHER_UID)
    try:
        with pytest.raises(
            DiskTierError, match=f"owned by uid {OTHER_UID}, not by the running user"
        ):
            DiskTier(tmp_path / "disk", 4, FP)
        owner = path.stat()
        assert (owner.st_uid, owner.st_mode) == (OTHER_UID, mode)
    finally:
        os.chown(path, os.getuid(), os.getgid())
    assert first.path.read_bytes() == before


def test_what_the_tier_creates_is_private(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "disk", 4, FP)
    tier.close()
    modes = {
        path: stat.S_IMODE(path.stat().st_mode)
        for path in (tmp_path / "disk", tier.directory, tier.path, tier.directory / "lock")
    }
    assert list(modes.values()) == [0o700, 0o700, 0o600, 0o600]
    tier.directory.chmod(0o755)  # loosened by hand: tightened again on the next start
    tier.path.chmod(0o644)
    DiskTier(tmp_path / "disk", 4, FP).close()
    assert stat.S_IMODE(tier.directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(tier.path.stat().st_mode) == 0o600


@pytest.mark.parametrize("used", [False, True])
def test_a_fingerprint_directory_its_owner_may_not_write_in_is_refused_as_it_is(
    tmp_path: Path, used: bool
) -> None:
    """Made read-only by hand (0555), empty or with the tier's files: never made writable
    again behind its owner's back (it was made 0700), refused with the reason instead."""
    directory = tmp_path / FP.hex()
    if used:
        DiskTier(tmp_path, 4, FP).close()
    else:
        directory.mkdir()
    directory.chmod(0o555)
    before = sorted(path.name for path in directory.iterdir())
    with pytest.raises(DiskTierError, match=r"not writable by its owner \(mode 0555\)"):
        DiskTier(tmp_path, 4, FP)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o555
    assert sorted(path.name for path in directory.iterdir()) == before


@needs_binding_modes
@pytest.mark.parametrize(
    ("denied", "mode", "says"),
    [
        (
            "lock",
            0o400,
            r"cannot be opened by its owner.*\(mode 0400\); give its owner read and write",
        ),
        ("blocks.kvs", 0o400, r"cannot be opened by its owner.*\(mode 0400\)"),
        ("blocks.kvs", 0o200, r"cannot be opened by its owner.*\(mode 0200\)"),
        (".", 0o300, r"cannot be opened by its owner.*\(mode 0300\); give its owner read, write"),
    ],
    ids=["lock", "slot file read-only", "slot file write-only", "fingerprint directory"],
)
def test_a_file_its_owner_may_not_open_is_named_with_what_to_do(
    tmp_path: Path, denied: str, mode: int, says: str
) -> None:
    """An operator's chmod, or files left by another account: the line names the file the
    running user may not open (not just the directory), its mode, and what to do."""
    DiskTier(tmp_path, 4, FP).close()
    path = tmp_path / FP.hex() / denied if denied != "." else tmp_path / FP.hex()
    path.chmod(mode)
    try:
        with pytest.raises(DiskTierError, match=f"^disk tier path {re.escape(str(path))} {says}"):
            DiskTier(tmp_path, 4, FP)
        assert stat.S_IMODE(path.stat().st_mode) == mode  # refused as it is
    finally:
        path.chmod(0o700 if path.is_dir() else 0o600)
    DiskTier(tmp_path, 4, FP).close()


@needs_binding_modes
@pytest.mark.parametrize("made", ["fingerprint directory", "disk-dir"])
def test_a_directory_the_running_user_may_not_make_is_named_with_where_it_may_not_write(
    tmp_path: Path, made: str
) -> None:
    """As an engine starts the tier (no command line checked the directory first)."""
    root = tmp_path / "disk"
    parent, child = (root, root / FP.hex()) if made != "disk-dir" else (tmp_path, root)
    parent.mkdir(exist_ok=True)
    parent.chmod(0o500)
    try:
        with pytest.raises(DiskTierError) as refused:
            DiskTier(root, 4, FP)
    finally:
        parent.chmod(0o700)
    line = str(refused.value)
    assert line.startswith(f"disk tier directory {child} cannot be created"), line
    assert f"may not write in {parent} (owner uid {os.geteuid()}, mode 0500)" in line


@needs_root
@needs_binding_modes
def test_another_user_s_file_the_running_user_may_not_open_is_named_with_its_owner(
    tmp_path: Path,
) -> None:
    """Left by a run under another account (0600, that account's): its owner is what to fix."""
    DiskTier(tmp_path, 4, FP).close()
    lock = tmp_path / FP.hex() / "lock"
    os.chown(lock, OTHER_UID, OTHER_UID)
    with pytest.raises(
        DiskTierError, match=f"{re.escape(str(lock))} is owned by uid {OTHER_UID}, not by the"
    ):
        DiskTier(tmp_path, 4, FP)


HOLDER = """
import sys
from kvoffload import block_id_key
from kvoffload.tiers import DiskTier
tier = DiskTier(sys.argv[1], 8, bytes.fromhex(sys.argv[2]))
keys = [block_id_key(i) for i in range(5)]
tier.write(keys, [bytes(0)] * 5)
tier.poll(wait=True)
print("holding", flush=True)
sys.stdin.readline()
buffers = [bytearray(0) for _ in keys]
ok = tier.read(keys, lambda i: memoryview(buffers[i])).result(timeout=10)
print("kept", sum(ok), tier.present(keys), flush=True)
tier.close()
"""


def test_a_second_process_on_the_same_directory_is_refused_naming_the_holder(
    tmp_path: Path, fingerprint_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "disk"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root), fingerprint_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline() == "holding\n"
        assert main([*SIMULATE, "--disk-dir", str(root)]) != 0
        err = one_line_error(capsys)
        assert f"is in use by process {holder.pid}" in err
        with pytest.raises(DiskTierError, match=f"in use by process {holder.pid}"):
            DiskTier(root, 8, bytes.fromhex(fingerprint_dir))
        holder.stdin.write("go on\n")
        holder.stdin.flush()
        assert holder.stdout.readline() == "kept 5 5\n"  # the first keeps all its slots
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
        holder.stdout.close()
    assert holder.returncode == 0
    DiskTier(root, 8, bytes.fromhex(fingerprint_dir)).close()  # free again once it is gone


def test_a_holder_whose_lock_file_was_deleted_still_keeps_the_directory(tmp_path: Path) -> None:
    """With ``lock`` deleted under a running tier, a second process would lock a new file
    of that name: the slot file's own lock still refuses it, before it scans (and cuts)
    the first one's slots. Processes, not threads: a flock is per open file."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path), FP.hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline() == "holding\n"
        (tmp_path / FP.hex() / "lock").unlink()
        with pytest.raises(DiskTierError, match="is in use by another process, whose lock file"):
            DiskTier(tmp_path, 4, FP)  # a smaller capacity would cut the holder's slots
        holder.stdin.write("go on\n")
        holder.stdin.flush()
        assert holder.stdout.readline() == "kept 5 5\n"
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
        holder.stdout.close()
    assert holder.returncode == 0
    again = DiskTier(tmp_path, 8, FP)  # free again once it is gone, its blocks all there
    assert again.recovery.recovered == 5
    again.close()


FORK_CLOSER = """
import os
import sys
from kvoffload import block_id_key
from kvoffload.tiers import DiskTier
tier = DiskTier(sys.argv[1], 8, bytes.fromhex(sys.argv[2]))
keys = [block_id_key(i) for i in range(5)]
tier.write(keys, [bytes(0)] * 5)
tier.poll(wait=True)
child = os.fork()
if child == 0:  # the tier's copy here: its descriptors now point at /dev/null
    tier.empty_on_close = True
    tier.close()
    os._exit(0)
os.waitpid(child, 0)
buffers = [bytearray(0) for _ in keys]
print("kept", sum(tier.read(keys, lambda i: memoryview(buffers[i])).result(timeout=10)))
tier.close()
"""


def test_a_forked_child_s_copy_of_the_tier_never_empties_the_parent_s_slots(
    tmp_path: Path,
) -> None:
    """A forked child lets go of the slot file with its lock: its copy of the tier, closed
    with ``empty_on_close`` (as a reset does), truncated the parent's live file before,
    and every block the parent held was lost (the restart found none)."""
    parent = subprocess.run(
        [sys.executable, "-c", FORK_CLOSER, str(tmp_path), FP.hex()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert parent.returncode == 0, parent.stderr
    assert parent.stdout == "kept 5\n"
    again = DiskTier(tmp_path, 8, FP)
    assert again.recovery.recovered == 5
    again.close()


def test_two_tiers_of_one_process_on_one_directory_are_refused_too(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, 4, FP)
    try:
        with pytest.raises(DiskTierError, match=f"in use by process {os.getpid()}"):
            DiskTier(tmp_path, 4, FP)
        other = DiskTier(tmp_path, 4, layout_fingerprint("another", layout_preset("tiny"), 64))
        other.close()  # another layout has its own directory and lock
    finally:
        first.close()


FORKER = """
import os
import sys
import time
from kvoffload.tiers import DiskTier
tier = DiskTier(sys.argv[1], 4, bytes.fromhex(sys.argv[2]))
if os.fork() == 0:  # a forked helper that outlives its parent, as a worker pool's may
    print(os.getpid(), flush=True)  # from the child: past its fork handlers
    time.sleep(60)
    os._exit(0)
time.sleep(60)
"""


def test_a_crashed_holder_s_forked_child_does_not_keep_the_directory_locked(
    tmp_path: Path,
) -> None:
    """The lock belongs to the process that opened the tier: a child it forked inherits
    the lock's file but drops it, so a SIGKILL of the holder frees the directory even
    while the child lives on (the kernel releases a flock only with its last holder)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", FORKER, str(tmp_path), FP.hex()], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None
    forked = int(holder.stdout.readline())
    try:
        with pytest.raises(DiskTierError, match=f"in use by process {holder.pid}"):
            DiskTier(tmp_path, 4, FP)  # the holder keeps its lock after the fork
        holder.kill()
        holder.wait(timeout=30)
        DiskTier(tmp_path, 4, FP).close()
    finally:
        holder.kill()
        holder.wait(timeout=30)
        holder.stdout.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(forked, signal.SIGKILL)
