import hashlib
import struct
import subprocess
import sys
from collections.abc import Callable

import pytest

from kvoffload import (
    InvalidArgumentError,
    block_id_key,
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


@pytest.mark.parametrize("block_size", [0, -3, 1.5, 2.0, "2", None, True])
def test_bad_block_size_is_a_clear_error(block_size: object) -> None:
    """Not ``struct.error`` (a float or a huge size in the struct's format), nor a
    ``TypeError`` from the comparison, nor ``True`` taken as 1."""
    with pytest.raises(InvalidArgumentError, match="block_size"):
        hash_token_blocks([1, 2, 3], block_size)  # type: ignore[arg-type]


def test_a_block_larger_than_the_tokens_hashes_nothing_however_large() -> None:
    assert hash_token_blocks([1, 2, 3], 2**63) == []  # no struct of 2**63 fields is built


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"token_ids": None}, "token_ids"),
        ({"token_ids": 7}, "token_ids"),
        ({"parent_hash": None}, "parent_hash"),
        ({"parent_hash": "00"}, "parent_hash"),
    ],
)
def test_bad_tokens_or_parent_are_refused_naming_them(
    fields: dict[str, object], named: str
) -> None:
    arguments: dict[str, object] = {"token_ids": [1, 2, 3, 4], "block_size": 2, **fields}
    with pytest.raises(InvalidArgumentError, match=named):
        hash_token_blocks(**arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("parent", "hint"),
    [(b"", ""), (b"\x01" * 31, ""), (b"\x01" * 64, ""), (b"\x01" * 36, "get_offload_block_hash")],
    ids=["empty", "short", "long", "offload-key"],
)
def test_a_parent_hash_of_another_length_is_refused(parent: bytes, hint: str) -> None:
    """Every hash of a chain is 32 bytes: ``b""`` or an offload key (4 bytes longer) as the
    parent used to start a chain no other caller's prefix ever matched, silently."""
    with pytest.raises(InvalidArgumentError, match=f"parent_hash must be a 32-byte.*{hint}"):
        hash_token_blocks([1, 2, 3, 4], 2, parent_hash=parent)


def test_a_chain_continued_from_its_last_hash_is_the_whole_chain() -> None:
    whole = hash_token_blocks(list(range(12)), 4)
    head = hash_token_blocks(list(range(8)), 4)
    assert hash_token_blocks(list(range(8, 12)), 4, parent_hash=head[-1]) == whole[2:]


def test_non_integer_tokens_are_a_clear_error() -> None:
    with pytest.raises(InvalidArgumentError, match="64 bits"):
        hash_token_blocks([1, 2**70], 2)


def test_block_id_key_is_eight_big_endian_bytes_and_group() -> None:
    key = block_id_key(258, group_idx=3)
    assert get_offload_block_hash(key) == (258).to_bytes(8, "big")
    assert get_offload_group_idx(key) == 3
    assert block_id_key(1) != block_id_key(256)


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda: make_offload_key(b"ab", -1), "group_idx"),
        (lambda: make_offload_key(b"ab", 2**32), "group_idx"),
        (lambda: make_offload_key(b"ab", 1.0), "group_idx"),
        (lambda: make_offload_key(b"ab", None), "group_idx"),
        (lambda: make_offload_key("ab", 0), "block_hash"),
        (lambda: make_offload_key(None, 0), "block_hash"),
        (lambda: make_offload_key(bytearray(b"ab"), 0), "block_hash"),  # a key no dict takes
        (lambda: block_id_key(-1), "block_id"),
        (lambda: block_id_key(2**64), "block_id"),
        (lambda: block_id_key("7"), "block_id"),
        (lambda: block_id_key(7, group_idx=-1), "group_idx"),
        (lambda: keys_for_tokens(range(4), 2, group_idx=2**40), "group_idx"),
        # bool is an int subclass: True was group (or block) 1, False 0
        (lambda: make_offload_key(b"ab", True), "group_idx"),
        (lambda: make_offload_key(b"ab", False), "group_idx"),
        (lambda: keys_for_tokens(range(4), 2, group_idx=True), "group_idx"),
        (lambda: block_id_key(True), "block_id"),
        (lambda: block_id_key(7, group_idx=True), "group_idx"),
    ],
)
def test_a_bad_key_part_is_refused_naming_it(call: Callable[[], object], named: str) -> None:
    """Not an ``OverflowError`` or ``AttributeError`` from ``int.to_bytes``."""
    with pytest.raises(InvalidArgumentError, match=named):
        call()
