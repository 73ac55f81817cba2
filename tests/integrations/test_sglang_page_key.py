"""SGLang's page keys as ours: its page hashes as their bytes, and no two strings as one key."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("sglang", reason="SGLang is not installed (CI installs it --no-deps)")

from sglang_helpers import page_hash

from kvoffload.core.keys import make_offload_key
from kvoffload.integrations.sglang.storage import page_key

HEX = "0123456789abcdefABCDEF "
"""Hex digits of both cases and the space ``bytes.fromhex`` skips: where keys once met."""


def test_a_page_hash_is_its_bytes() -> None:
    """The key existing disk and shared tiers hold SGLang's pages under."""
    digest = page_hash(7)
    assert page_key(digest) == make_offload_key(bytes.fromhex(digest), 0)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("0", "30"),  # UTF-8 "0" is 0x30
        ("0g", "3067"),  # "3067" as bytes is "0g"
        ("ab", "AB"),
        ("abcd", "ab cd"),
        (page_hash(1), page_hash(1).upper()),
        # 31 bytes and one end mark would be the page hash of those 32 bytes.
        ("x" * 31, (b"x" * 31 + b"\xff").hex()),
    ],
)
def test_strings_that_met_have_keys_of_their_own(one: str, other: str) -> None:
    assert page_key(one) != page_key(other)


def _spellings(text: str) -> list[str]:
    """``text``, and the hex of its UTF-8 bytes in both cases: strings once read as one."""
    raw = text.encode("utf-8", "surrogatepass").hex()
    return [text, raw, raw.upper()]


@given(
    st.lists(
        st.one_of(
            st.text(),
            st.text(st.characters(exclude_categories=())),  # lone surrogates too
            st.text(alphabet=HEX),
            st.text(alphabet=HEX, min_size=62, max_size=66),
            st.binary(min_size=32, max_size=32).map(bytes.hex),
            st.text(min_size=8, max_size=33),  # UTF-8 about a page hash's 32 bytes
            st.binary(max_size=31).map(lambda raw: (raw + b"\xff" * (32 - len(raw))).hex()),
        ).map(_spellings)
    ).map(lambda groups: list(dict.fromkeys(key for group in groups for key in group)))
)
def test_distinct_strings_have_distinct_keys(keys: list[str]) -> None:
    assert len({page_key(key) for key in keys}) == len(keys)
