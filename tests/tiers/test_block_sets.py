"""Pipelined SETs with header and payload sent apart, against real Valkey servers."""

from __future__ import annotations

import pytest
import valkey

from kvoffload import block_id_key
from kvoffload.core.layout import layout_preset
from kvoffload.tiers import RemoteTier, layout_fingerprint
from kvoffload.tiers.block_sets import JOIN_BELOW, BlockWrite, pack_sets, send_sets
from kvoffload.tiers.format import decode_block, encode_header
from tier_servers import ValkeyClusterProcesses, ValkeyProcess

FP = layout_fingerprint("block-sets", layout_preset("tiny"), 0)


def writes_of(sizes: list[int], prefix: bytes = b"bs:") -> list[BlockWrite]:
    writes = []
    for i, size in enumerate(sizes):
        key = block_id_key(i)
        payload = bytes((i + j) % 251 for j in range(size))
        writes.append(BlockWrite(prefix + key.hex().encode(), key, payload))
    return writes


def test_large_payloads_go_out_as_they_are_and_small_ones_are_joined() -> None:
    writes = writes_of([10, JOIN_BELOW, 3, JOIN_BELOW + 1, 0])
    pieces = list(pack_sets(writes, FP))
    assert [piece is writes[i].payload for i in (1, 3) for piece in pieces].count(True) == 2
    assert len(pieces) == 5  # commands before block 1, block 1, between, block 3, the rest
    assert b"".join(pieces).count(b"*3\r\n$3\r\nSET\r\n") == len(writes)


SIZES = [0, 1, 7, 100, JOIN_BELOW - 1, JOIN_BELOW, 3 * JOIN_BELOW + 5, 2**20, 5, 2**20 + 3]


def test_every_value_reads_back_as_header_then_payload(valkey_server: ValkeyProcess) -> None:
    client = valkey_server.client()
    writes = writes_of(SIZES)
    send_sets([(client.connection_pool, writes)], FP)
    for i, (name, key, payload) in enumerate(writes):
        value = client.get(name)
        assert value == encode_header(key, FP, payload) + payload
        assert bytes(decode_block(value, block_id_key(i), FP)) == payload
    client.delete(*(write.name for write in writes))


def test_an_error_reply_raises_after_every_reply_is_read_and_the_connection_stays(
    own_server: ValkeyProcess,
) -> None:
    own_server.start()
    admin = own_server.client()
    admin.acl_setuser(
        "writer", enabled=True, passwords=["+pw"], keys=["allowed:*"], commands=["+@all"]
    )
    client = valkey.Valkey(
        "127.0.0.1", own_server.port, username="writer", password="pw", socket_timeout=5
    )
    try:
        client.ping()
        connections = admin.info("stats")["total_connections_received"]
        refused = writes_of([2**20, 10], prefix=b"refused:")
        allowed = writes_of([2**20, 10], prefix=b"allowed:")
        with pytest.raises(valkey.exceptions.NoPermissionError):
            send_sets([(client.connection_pool, [refused[0], *allowed, refused[1]])], FP)
        assert [admin.get(write.name) for write in allowed] == [
            encode_header(write.key, FP, write.payload) + write.payload for write in allowed
        ]
        send_sets([(client.connection_pool, allowed)], FP)  # no stale reply is read as this one's
        assert admin.info("stats")["total_connections_received"] == connections
        assert admin.exists(*(write.name for write in refused)) == 0
    finally:
        client.close()


def test_a_cluster_write_after_a_stale_slot_map_follows_the_redirection(
    valkey_cluster: ValkeyClusterProcesses,
) -> None:
    tier = RemoteTier(valkey_cluster.url, FP)
    try:
        keys = [block_id_key(i, 77) for i in range(30)]
        client = tier._client
        slot = client.keyslot(tier.name(keys[0]))
        owner = client.nodes_manager.slots_cache[slot][0]
        stranger = next(node for node in client.get_primaries() if node.name != owner.name)
        client.nodes_manager.slots_cache[slot] = [stranger]  # as after a resharding
        payloads = [bytes([i]) * 40_000 for i in range(len(keys))]
        tier.write(keys, payloads)
        tier.poll(wait=True)
        assert tier.stats.stored_blocks == len(keys) and tier.stats.failed == 0
        buffers = [bytearray(40_000) for _ in keys]
        assert all(tier.read(keys, lambda i: memoryview(buffers[i])).result(timeout=10))
        assert [bytes(buffer) for buffer in buffers] == payloads
        assert client.nodes_manager.slots_cache[slot][0].name == owner.name
        tier.delete_all()
    finally:
        tier.close()


def test_batches_for_two_servers_are_all_sent_and_an_error_in_one_spares_the_other(
    valkey_server: ValkeyProcess, own_server: ValkeyProcess
) -> None:
    own_server.start()
    own_server.client().acl_setuser(
        "writer", enabled=True, passwords=["+pw"], keys=["allowed:*"], commands=["+@all"]
    )
    limited = valkey.Valkey(
        "127.0.0.1", own_server.port, username="writer", password="pw", socket_timeout=5
    )
    first = valkey_server.client()
    try:
        to_first = writes_of([2**20, 50], prefix=b"two-servers:")
        to_second = writes_of([30, 2**20], prefix=b"allowed:") + writes_of([5], b"refused:")
        batches = [(limited.connection_pool, to_second), (first.connection_pool, to_first)]
        with pytest.raises(valkey.exceptions.NoPermissionError):
            send_sets(batches, FP)
        for client, writes in ((first, to_first), (own_server.client(), to_second[:2])):
            assert [client.get(write.name) for write in writes] == [
                encode_header(write.key, FP, write.payload) + write.payload for write in writes
            ]
        send_sets(batches[1:], FP)  # the connections went back clean
        first.delete(*(write.name for write in to_first))
    finally:
        limited.close()
