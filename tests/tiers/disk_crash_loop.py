"""Kill disk tier writers with SIGKILL at random points, many times; too slow for the suite.

    PYTHONPATH=src python tests/tiers/disk_crash_loop.py --rounds 200 --seed 1

Each round makes a directory and runs one to four writer processes on it, one after
the other, each killed at a random moment while it stores, reads and evicts blocks
(keys of several lengths, 1 to 8 slots, 1 to 3 I/O threads, ``fsync`` now and then);
after each kill a restart, sometimes with another capacity, reads every block it
indexed. Each block's bytes name its key and which of its contents they are, so an
indexed block that does not read as intact, or reads as intact but holds another key's
bytes or a mix of two contents, is found. Exits 1 if any was.
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from subprocess import PIPE

from kvoffload.core.keys import OffloadKey
from kvoffload.core.layout import layout_preset
from kvoffload.tiers import DiskTier, layout_fingerprint

KEY_LENGTHS = (3, 36, 200, 1, 90)
VERSIONS = 3
"""Stores of one key write one of this many contents, each naming its version."""

WRITER = f"""
import random, struct, sys
from kvoffload.core.keys import OffloadKey
from kvoffload.tiers import DiskTier
directory, fingerprint, capacity, size, threads, fsync, seed = sys.argv[1:8]
capacity, size, seed = int(capacity), int(size), int(seed)
lengths = {KEY_LENGTHS}
rng = random.Random(seed)
tier = DiskTier(directory, capacity, bytes.fromhex(fingerprint), io_threads=int(threads),
                fsync=fsync == "1")
keys = [OffloadKey(bytes([65 + k]) * lengths[k % len(lengths)]) for k in range(capacity * 3)]
blocks = [[(struct.pack("<II", k, v) * (size // 8 + 1))[:size] for v in range({VERSIONS})]
          for k in range(capacity * 3)]
buffers = [bytearray(size) for _ in range(3)]
print("storing", flush=True)
while True:  # made up in advance: the time goes to the tier, where a kill should land
    ks = rng.sample(range(capacity * 3), rng.randint(1, 3))
    v = rng.randrange({VERSIONS})
    tier.write([keys[k] for k in ks], [blocks[k][v] for k in ks])
    if rng.random() < 0.3:
        ks = rng.sample(range(capacity * 3), 3)
        tier.read([keys[k] for k in ks], lambda i: memoryview(buffers[i]))
    tier.poll(wait=rng.random() < 0.3)
"""


def key(k: int) -> OffloadKey:
    return OffloadKey(bytes([65 + k]) * KEY_LENGTHS[k % len(KEY_LENGTHS)])


def wrong_blocks(directory: str, fingerprint: bytes, capacity: int, keys: int, size: int) -> int:
    """Blocks the restarted tier indexes that do not read back as one store of their key."""
    tier = DiskTier(directory, capacity, fingerprint)
    try:
        held = [k for k in range(keys) if tier.present([key(k)])]
        buffers = [bytearray(size) for _ in held]
        intact = tier.read([key(k) for k in held], lambda i: memoryview(buffers[i]))
        wrong = 0
        for k, buffer, ok in zip(held, buffers, intact.result(timeout=60), strict=True):
            found, version = struct.unpack_from("<II", buffer)
            if (
                not ok
                or found != k
                or buffer != (struct.pack("<II", k, version) * (size // 8 + 1))[:size]
            ):
                wrong += 1
                print(f"key {k}: read {ok}, holds key {found}, version {version}", flush=True)
        return wrong
    finally:
        tier.close()


def one_round(rng: random.Random) -> int:
    directory = tempfile.mkdtemp(prefix="kvoffload-crash-")
    try:
        size = rng.choice([64, 4000, 65536, 1 << 20])
        fingerprint = layout_fingerprint("crash-loop", layout_preset("tiny"), size)
        capacity = rng.choice([1, 2, 4, 8])
        wrong = 0
        for _ in range(rng.randint(1, 4)):
            arguments = [directory, fingerprint.hex(), str(capacity), str(size)]
            arguments += [str(rng.choice([1, 2, 3])), rng.choice("001"), str(rng.randrange(999))]
            writer = subprocess.Popen([sys.executable, "-c", WRITER, *arguments], stdout=PIPE)
            assert writer.stdout is not None
            started = writer.stdout.readline() == b"storing\n"
            time.sleep(rng.uniform(0.0, 0.4))
            writer.send_signal(signal.SIGKILL)
            writer.wait()
            writer.stdout.close()
            if not started or writer.returncode != -signal.SIGKILL:
                raise SystemExit(f"a writer ended by itself (exit status {writer.returncode})")
            restart = capacity if rng.random() < 0.7 else rng.choice([1, 2, 4, 8, 16])
            wrong += wrong_blocks(directory, fingerprint, restart, capacity * 3, size)
        return wrong
    finally:
        shutil.rmtree(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    wrong = sum(one_round(rng) for _ in range(args.rounds))
    print(f"{args.rounds} rounds, {wrong} wrong blocks")
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
