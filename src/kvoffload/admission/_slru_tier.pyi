from typing_extensions import Self

class SLRUTier:
    """An SLRU mini-tier of ``capacity`` keys in C.

    Its operations (the store, touch, hit run and prefix reads, the counters, ``held``,
    ``capacity``, ``memory_bytes``) are those of
    ``minisim.MiniTier``, the Python class the compiled subclass mixes it into, and
    are declared there once.
    """

    protected_limit: int
    def __new__(cls, capacity: int, pending: bool, protected_limit: int) -> Self: ...
