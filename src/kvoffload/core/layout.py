"""How many bytes one KV block occupies, described without any tensor library.

The simulator turns block counts into bytes with it; the data plane builds the
engine's paged KV tensors from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.core.errors import InvalidArgumentError

DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4, "float8": 1}


@dataclass(frozen=True)
class KVLayout:
    """Shape of a model's KV cache: per layer, K and V of ``kv_heads * head_dim`` per token."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    tokens_per_block: int = 16

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim", "tokens_per_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:
            raise InvalidArgumentError(
                f"unknown KV dtype {self.dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}"
            )

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.tokens_per_block

    @property
    def page_bytes(self) -> int:
        """One layer's K (or V) of one block: the unit the engine's tensors are paged in."""
        return self.tokens_per_block * self.kv_heads * self.head_dim * self.dtype_bytes

    def with_block_size(self, tokens_per_block: int) -> KVLayout:
        return KVLayout(self.num_layers, self.kv_heads, self.head_dim, self.dtype, tokens_per_block)


LAYOUT_PRESETS: dict[str, KVLayout] = {
    "llama-3.1-8b": KVLayout(num_layers=32, kv_heads=8, head_dim=128),
    "llama-3.2-1b": KVLayout(num_layers=16, kv_heads=8, head_dim=64),
    "qwen3-8b": KVLayout(num_layers=36, kv_heads=8, head_dim=128),
    "llama-3.1-70b-tp8": KVLayout(num_layers=80, kv_heads=1, head_dim=128),
    "tiny": KVLayout(num_layers=2, kv_heads=2, head_dim=16, dtype="float16"),
}
"""Per-GPU KV shapes of common models (16-token blocks; override with ``with_block_size``)."""


def layout_preset(name: str) -> KVLayout:
    """The preset called ``name``; the error lists the known ones."""
    try:
        return LAYOUT_PRESETS[name]
    except (KeyError, TypeError):  # TypeError: a name that cannot be a key (a list)
        raise InvalidArgumentError(
            f"unknown KV layout {name!r}; known: {', '.join(sorted(LAYOUT_PRESETS))}"
        ) from None
