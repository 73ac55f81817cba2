class LRUTier:
    """An LRU mini-tier of ``capacity`` keys in C.

    Its operations (the store, touch, hit run and prefix reads, the counters, ``held``,
    ``capacity``, ``memory_bytes``) are those of
    ``minisim.LRUMiniTier``, the Python class the compiled subclass mixes it into, and
    are declared there once.
    """

    def __new__(cls, capacity: int) -> LRUTier: ...
