from typing import Any

import pytest

from kvoffload import InvalidArgumentError, KVLayout, layout_preset


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"num_layers": True}, "num_layers"),
        ({"kv_heads": 2.0}, "kv_heads"),
        ({"head_dim": 0}, "head_dim"),
        ({"tokens_per_block": True}, "tokens_per_block"),
        ({"dtype": ["float16"]}, "dtype"),
        ({"dtype": "int4"}, "dtype"),
    ],
)
def test_a_bad_layout_field_is_refused_naming_it(fields: dict[str, Any], named: str) -> None:
    """``True`` is no count of layers, and a list no dtype (not a ``TypeError`` from the
    dtype table)."""
    values: dict[str, Any] = {"num_layers": 2, "kv_heads": 2, "head_dim": 16, **fields}
    with pytest.raises(InvalidArgumentError, match=named):
        KVLayout(**values)


@pytest.mark.parametrize("name", ["nope", ["tiny"], None])
def test_an_unknown_preset_is_refused_listing_the_known(name: Any) -> None:
    with pytest.raises(InvalidArgumentError, match=r"known: .*tiny"):
        layout_preset(name)
