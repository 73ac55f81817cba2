"""The shared tier when someone else changes the server under it: a ``FLUSHALL``, values
overwritten with bytes of the right length, a server paused in the middle of a batch.

Each test has a server of its own (``own_server``): what it does to the server would
disturb the session's. No wrong byte is ever loaded, nothing raises, and the tier goes
on by itself.
"""

from __future__ import annotations

import os
import signal
import threading

from tier_helpers import STALL_S, content, finishes
from tier_helpers import remote_preload as preload
from tier_helpers import remote_read as read
from tier_helpers import remote_store as store
from tier_helpers import tiny_fingerprint as fingerprint

from kvoffload import block_id_key
from kvoffload.tiers import CircuitBreaker, RemoteTier
from kvoffload.tiers.format import encode_trailed_block
from tier_servers import ValkeyProcess

BLOCK = 32
BIG = 256 * 2**10
"""A block size whose batch outlasts the start of a pause: the socket buffers fill."""
KEYS = [block_id_key(i, 11) for i in range(48)]


def test_a_flushall_behind_the_tier_s_back_is_plain_misses(own_server: ValkeyProcess) -> None:
    own_server.start()
    tier = RemoteTier(own_server.url, fingerprint("flushall"))
    try:
        store(tier, KEYS[:8])
        own_server.client().flushall()
        assert tier.present(KEYS[:8]) == 0 and read(tier, KEYS[:8]) == [False] * 8
        assert tier.stats.corrupt == tier.stats.failed == tier.unavailable == 0
        assert not tier.breaker.is_open
        store(tier, KEYS[:4])
        assert read(tier, KEYS[:8]) == [True] * 4 + [False] * 4
    finally:
        tier.close()


def test_values_overwritten_with_bytes_of_the_right_length_are_never_loaded(
    own_server: ValkeyProcess,
) -> None:
    """Another client's writes that keep the layout's length, so only the checks on the
    bytes themselves can refuse them: random bytes, zeros, the key's own header over
    another key's payload, the key's header with one byte of its key changed."""
    own_server.start()
    client = own_server.client()
    fp = fingerprint("right-length")
    tier = RemoteTier(own_server.url, fp)
    try:
        store(tier, KEYS[:5])
        length = len(client.get(tier.name(KEYS[0])) or b"")
        assert length > BLOCK
        client.set(tier.name(KEYS[1]), os.urandom(length))
        client.set(tier.name(KEYS[2]), bytes(length))
        swapped = encode_trailed_block(KEYS[3], fp, content(KEYS[3], BLOCK))
        payload = content(KEYS[0], BLOCK)
        swapped = swapped[: -BLOCK - 8] + payload + swapped[-8:]
        client.set(tier.name(KEYS[3]), swapped)
        renamed = bytearray(client.get(tier.name(KEYS[4])) or b"")
        renamed[length - BLOCK - 9] ^= 0x01  # the key's last byte, before the payload
        client.set(tier.name(KEYS[4]), bytes(renamed))
        assert all(len(client.get(tier.name(key)) or b"") == length for key in KEYS[:5])
        assert read(tier, KEYS[:5]) == [True, False, False, False, False]
        assert tier.stats.corrupt == 4 and tier.stats.failed == tier.unavailable == 0
        assert [client.exists(tier.name(key)) for key in KEYS[:5]] == [1, 0, 0, 0, 0]
        store(tier, KEYS[1:5])
        assert read(tier, KEYS[:5]) == [True] * 5
    finally:
        tier.close()


def test_a_server_paused_in_the_middle_of_a_batch_keeps_only_whole_values(
    own_server: ValkeyProcess,
) -> None:
    """Paused (``SIGSTOP``) while a large write batch goes out: the call ends by its
    deadline; once resumed, the server runs the whole commands it had and drops the
    one cut short with its connection, so every value it holds loads whole, none is
    corrupt, and the breaker lets the tier back in."""
    own_server.start()
    process = own_server.process
    assert process is not None
    breaker = CircuitBreaker(threshold=2, cooldown_s=0.2)
    tier = RemoteTier(own_server.url_with(300), fingerprint("paused", BIG), breaker=breaker)
    try:
        tier.write(KEYS, [content(key, BIG) for key in KEYS])
        process.send_signal(signal.SIGSTOP)
        finishes(lambda: tier.poll(wait=True))
        assert tier.stats.stored_blocks + tier.stats.failed == len(KEYS)
        assert finishes(lambda: read(tier, KEYS[:4], BIG)) == [False] * 4
        process.send_signal(signal.SIGCONT)
        threading.Event().wait(0.25)  # the breaker's cool-down
        held = tier.held(KEYS)  # a value still landing may load without being counted here
        loaded = read(tier, KEYS, BIG)
        assert all(ok for ok, was in zip(loaded, held, strict=True) if was)
        assert tier.stats.corrupt == 0
        assert not breaker.is_open
        store(tier, KEYS, BIG)
        assert read(tier, KEYS, BIG) == [True] * len(KEYS)
    finally:
        process.send_signal(signal.SIGCONT)
        tier.close()


def test_a_read_is_not_held_behind_writes_to_a_paused_server(own_server: ValkeyProcess) -> None:
    """A read asked while write pipelines to a hung server are under way ends by its own
    deadline, not by theirs: pipelines of 256 MiB get 0.3 s + 2.7 s each, a 32-byte
    read 0.3 s, so it ends while they are all still under way. (Reads and writes shared
    the I/O threads: the read waited behind the pipelines queued before it until two had
    failed, 3 s here, and the breaker they opened then refused it unasked.)"""
    own_server.start()
    process = own_server.process
    assert process is not None
    breaker = CircuitBreaker(threshold=1)  # the read's failure refuses the pipelines not begun
    tier = RemoteTier(own_server.url_with(300), fingerprint("behind"), breaker=breaker)
    written = [block_id_key(i, 12) for i in range(64)]
    huge = bytes(16 * 2**20)
    try:
        store(tier, KEYS[:1])
        process.send_signal(signal.SIGSTOP)
        for batch in range(4):  # four pipelines of 16 blocks of 16 MiB, on two I/O threads
            tier.write(written[16 * batch : 16 * batch + 16], [huge] * 16)
        assert finishes(lambda: read(tier, KEYS[:1])) == [False]
        tier.poll(wait=False)
        assert tier.stats.failed == 1  # the read's block alone: no write has ended yet
        finishes(lambda: tier.poll(wait=True))
        assert tier.stats.failed == 1 + len(written)
    finally:
        process.send_signal(signal.SIGCONT)
        tier.close()


def test_a_read_queued_behind_another_fails_by_its_own_deadline(
    own_server: ValkeyProcess,
) -> None:
    """On one read thread, a one-block read asked behind a 16 MiB read to a paused server
    fails by its own deadline (0.5 s from when it was asked), before the 16 MiB read's
    (0.5 s + 0.17 s) frees the thread: the server resumed then serves it nothing. (Its
    deadline started once the thread took it: it waited the 16 MiB read out, then got
    0.5 s more, and loaded from the resumed server.)"""
    own_server.start()
    process = own_server.process
    assert process is not None
    size = 8 * 2**20
    fp = fingerprint("queued", size)
    preload(own_server.url, fp, KEYS[:3], size)
    breaker = CircuitBreaker(threshold=100)  # the read ahead's failure refuses nothing
    tier = RemoteTier(own_server.url_with(500), fp, breaker=breaker, io_threads=1)
    try:
        buffers = [bytearray(size) for _ in range(3)]
        process.send_signal(signal.SIGSTOP)
        ahead = tier.read(KEYS[:2], lambda i: memoryview(buffers[i]))
        queued = tier.read(KEYS[2:3], lambda i: memoryview(buffers[2]))
        assert ahead.result(timeout=STALL_S) == [False, False]
        process.send_signal(signal.SIGCONT)
        assert queued.result(timeout=STALL_S) == [False]
        assert tier.stats.failed == 3 and tier.unavailable == 2
        assert read(tier, KEYS[2:3], size) == [True]  # the thread is free again
    finally:
        process.send_signal(signal.SIGCONT)
        tier.close()


def test_reads_are_served_while_the_server_holds_the_writes(own_server: ValkeyProcess) -> None:
    """``CLIENT PAUSE ... WRITE`` (what Valkey does during a failover) holds the stores
    and serves reads: a read asked behind four write pipelines lands at once. (It waited
    behind them until the pause ended.)"""
    own_server.start()
    tier = RemoteTier(own_server.url_with(5000), fingerprint("write-pause"))
    written = [block_id_key(i, 14) for i in range(64)]
    try:
        store(tier, KEYS[:1])
        own_server.client().execute_command("CLIENT", "PAUSE", "1000", "WRITE")
        for batch in range(4):
            store_keys = written[16 * batch : 16 * batch + 16]
            tier.write(store_keys, [content(key, BLOCK) for key in store_keys])
        assert finishes(lambda: read(tier, KEYS[:1])) == [True]
        tier.poll(wait=False)
        assert tier.stats.stored_blocks == 1  # the writes are still held
        finishes(lambda: tier.poll(wait=True))
        assert tier.stats.stored_blocks == 1 + len(written) and tier.stats.failed == 0
    finally:
        tier.close()
