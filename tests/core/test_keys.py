import hashlib
import struct
import subprocess
import sys

import pytest

from kvoffload import (
    InvalidArgumentError,
    get_offload_block_hash,
    get_offload_group_idx,
    hash_token_blocks,
    keys_for_tokens,
    make_offload_key,
)


def test_key_is_hash_then_big_endian_group() -> None:
    key = make_offload_key(b"\xab\xcd", 258)
    assert key == b"\xab\xcd\x00\x00\x01\x02"
    assert get_offload_block_hash(key) == b"\xab\xcd"
    assert get_offload_group_idx(key) == 258


def test_chained_hash_matches_definition() -> None:
    tokens = list(range(10))
    hashes = hash_token_blocks(tokens, block_size=4)
    assert len(hashes) == 2  # the partial last block (8, 9) is not hashed
    first = hashlib.sha256(b"\x00" * 32 + struct.pack("<4q", 0, 1, 2, 3)).digest()
    second = hashlib.sha256(first + struct.pack("<4q", 4, 5, 6, 7)).digest()
    assert hashes == [first, second]


def test_hash_covers_the_whole_prefix() -> None:
    base = hash_token_blocks(list(range(12)), 4)
    changed_head = hash_token_blocks([99, *range(1, 12)], 4)
    changed_tail = hash_token_blocks([*range(11), 99], 4)
    assert all(a != b for a, b in zip(base, changed_head, strict=True))
    assert base[:2] == changed_tail[:2] and base[2] != changed_tail[2]


def test_hashes_are_identical_in_another_process() -> None:
    code = "from kvoffload import keys_for_tokens; print(keys_for_tokens(range(64), 16)[-1].hex())"
    other = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert other == keys_for_tokens(range(64), 16)[-1].hex()


@pytest.mark.parametrize("block_size", [0, -3])
def test_bad_block_size_is_a_clear_error(block_size: int) -> None:
    with pytest.raises(InvalidArgumentError, match="block_size"):
        hash_token_blocks([1, 2, 3], block_size)


def test_non_integer_tokens_are_a_clear_error() -> None:
    with pytest.raises(InvalidArgumentError, match="64 bits"):
        hash_token_blocks([1, 2**70], 2)


def test_block_id_key_is_eight_big_endian_bytes_and_group() -> None:
    from kvoffload import block_id_key

    key = block_id_key(258, group_idx=3)
    assert get_offload_block_hash(key) == (258).to_bytes(8, "big")
    assert get_offload_group_idx(key) == 3
    assert block_id_key(1) != block_id_key(256)
