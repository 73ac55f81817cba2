"""Which on-disk layout for the disk tier: a file per block, a segment, or a slot file?

All three write the same blocks (the tier's header, then the payload) and
read them back into one buffer, in the same run, on one thread, beside the
``plain`` payloads written to one file as they are, and the payload digest
alone (``digest_gbps``: what every layout adds to the plain write):

* ``file``: each block in its own temporary file, renamed into place (what
  :class:`kvoffload.tiers.DiskTier` did first: a crash leaves whole blocks only);
* ``segment``: blocks appended to one segment file, with an index of
  (key, offset, length) and a CRC32 written after the batch;
* ``slab``: blocks written in place into fixed-size slots of one sparse file,
  the old header zeroed with the payload and the new header written last
  (what the tier does now: a crash leaves a slot without a valid header).

With ``--fsync`` each file is synced before its rename, the segment once per
batch, and the slab twice per batch (payloads, then headers). Best of ``--rounds``.

    python benchmarks/disk_layouts.py [--blocks 128] [--block-mib 2] [--fsync] [--dir PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import tempfile
import time
import zlib
from pathlib import Path

from kvoffload import block_id_key
from kvoffload.core.layout import layout_preset
from kvoffload.tiers.format import (
    encode_header,
    layout_fingerprint,
    parse_header,
    payload_digest,
)
from kvoffload.tiers.slot_file import SUPER_BYTES, encode_superblock, slot_stride


def file_per_block(directory: Path, blocks: list[tuple[bytes, bytes]], fsync: bool) -> float:
    started = time.perf_counter()
    for key, payload in blocks:
        final = directory / (key.hex() + ".kvb")
        temp = final.with_suffix(".tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.writev(fd, [encode_header(key, FP, payload), payload])
        if fsync:
            os.fsync(fd)
        os.close(fd)
        os.replace(temp, final)
    return time.perf_counter() - started


def read_files(directory: Path, blocks: list[tuple[bytes, bytes]], buffer: memoryview) -> float:
    size = len(blocks[0][1])
    started = time.perf_counter()
    for i, (key, _) in enumerate(blocks):
        with open(directory / (key.hex() + ".kvb"), "rb", buffering=0) as file:
            file.seek(len(encode_header(key, FP, b"")))
            file.readinto(buffer[i * size : (i + 1) * size])
    return time.perf_counter() - started


def segment(directory: Path, blocks: list[tuple[bytes, bytes]], fsync: bool) -> float:
    started = time.perf_counter()
    index = []
    with open(directory / "segment.kvs", "wb", buffering=0) as file:
        offset = 0
        for key, payload in blocks:
            header = encode_header(key, FP, payload)
            os.writev(file.fileno(), [header, payload])
            index.append((key, offset + len(header), len(payload)))
            offset += len(header) + len(payload)
        if fsync:
            os.fsync(file.fileno())
    entries = b"".join(key + struct.pack("<QQ", at, n) for key, at, n in index)
    with open(directory / "segment.idx", "wb") as file:
        file.write(entries + struct.pack("<I", zlib.crc32(entries)))
        if fsync:
            os.fsync(file.fileno())
    return time.perf_counter() - started


def read_segment(directory: Path, blocks: list[tuple[bytes, bytes]], buffer: memoryview) -> float:
    size = len(blocks[0][1])
    entry = len(blocks[0][0]) + 16
    started = time.perf_counter()
    entries = (directory / "segment.idx").read_bytes()
    with open(directory / "segment.kvs", "rb", buffering=0) as file:
        for i in range(len(blocks)):
            at, n = struct.unpack_from("<QQ", entries, i * entry + entry - 16)
            file.seek(at)
            file.readinto(buffer[i * size : i * size + n])
    return time.perf_counter() - started


def slab(directory: Path, blocks: list[tuple[bytes, bytes]], fsync: bool) -> float:
    stride = slot_stride(len(blocks[0][1]))
    started = time.perf_counter()
    fd = os.open(directory / "blocks.kvs", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, encode_superblock(FP, stride, len(blocks[0][1])), 0)
        headers = []
        for slot, (key, payload) in enumerate(blocks):
            header = encode_header(key, FP, payload)
            os.pwritev(fd, [bytes(len(header)), payload], SUPER_BYTES + slot * stride)
            headers.append(header)
        if fsync:
            os.fdatasync(fd)
        for slot, header in enumerate(headers):
            os.pwrite(fd, header, SUPER_BYTES + slot * stride)
        if fsync:
            os.fdatasync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def read_slab(directory: Path, blocks: list[tuple[bytes, bytes]], buffer: memoryview) -> float:
    size = len(blocks[0][1])
    stride = slot_stride(size)
    head = len(encode_header(blocks[0][0], FP, b""))
    started = time.perf_counter()
    fd = os.open(directory / "blocks.kvs", os.O_RDONLY)
    try:
        for slot in range(len(blocks)):
            at = SUPER_BYTES + slot * stride
            parse_header(os.pread(fd, head, at))
            os.preadv(fd, [buffer[slot * size : (slot + 1) * size]], at + head)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def plain(directory: Path, blocks: list[tuple[bytes, bytes]], fsync: bool) -> float:
    started = time.perf_counter()
    with open(directory / "plain.bin", "wb", buffering=0) as file:
        for _, payload in blocks:
            file.write(payload)
        if fsync:
            os.fsync(file.fileno())
    return time.perf_counter() - started


def read_plain(directory: Path, blocks: list[tuple[bytes, bytes]], buffer: memoryview) -> float:
    size = len(blocks[0][1])
    started = time.perf_counter()
    with open(directory / "plain.bin", "rb", buffering=0) as file:
        for i in range(len(blocks)):
            file.readinto(buffer[i * size : (i + 1) * size])
    return time.perf_counter() - started


def digest(blocks: list[tuple[bytes, bytes]]) -> float:
    started = time.perf_counter()
    for _, payload in blocks:
        payload_digest(payload)
    return time.perf_counter() - started


FP = layout_fingerprint("bench", layout_preset("tiny"), 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--block-mib", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fsync", action="store_true")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    size = int(args.block_mib * 2**20)
    seed = os.urandom(size)
    blocks = [(block_id_key(i), i.to_bytes(8, "little") + seed[8:]) for i in range(args.blocks)]
    buffer = memoryview(bytearray(size * args.blocks))
    total = size * args.blocks
    best: dict[str, float] = {}
    for r in range(args.rounds):
        best["digest_gbps"] = max(best.get("digest_gbps", 0.0), total / digest(blocks) / 1e9)
        for name, write, read in (
            ("plain", plain, read_plain),
            ("file", file_per_block, read_files),
            ("segment", segment, read_segment),
            ("slab", slab, read_slab),
        ):
            scratch = Path(tempfile.mkdtemp(prefix=f"kvoffload-{name}-{r}-", dir=args.dir))
            try:
                times = {"write": write(scratch, blocks, args.fsync)}
                times["read"] = read(scratch, blocks, buffer)
            finally:
                shutil.rmtree(scratch)
            for op, seconds in times.items():
                label = f"{name}_{op}_gbps"
                best[label] = max(best.get(label, 0.0), total / seconds / 1e9)
    for name in ("file", "segment", "slab"):
        best[f"write_ratio_{name}_to_plain"] = best[f"{name}_write_gbps"] / best["plain_write_gbps"]
    best["write_ratio_file_to_segment"] = best["file_write_gbps"] / best["segment_write_gbps"]
    best["read_ratio_file_to_segment"] = best["file_read_gbps"] / best["segment_read_gbps"]
    best["write_ratio_slab_to_file"] = best["slab_write_gbps"] / best["file_write_gbps"]
    best["write_ratio_slab_to_segment"] = best["slab_write_gbps"] / best["segment_write_gbps"]
    best["read_ratio_slab_to_file"] = best["slab_read_gbps"] / best["file_read_gbps"]
    print(json.dumps(best, indent=2))


if __name__ == "__main__":
    main()
