from typing_extensions import Self

class S3FIFOTier:
    """An S3-FIFO mini-tier of ``capacity`` keys in C.

    Its operations (the store, touch, hit run and prefix reads, the counters, ``held``,
    ``capacity``, ``memory_bytes``) are those of
    ``minisim.S3FIFOMiniTier``, the Python class the compiled subclass mixes it into, and
    are declared there once.
    """

    small_target: int
    def __new__(cls, capacity: int, pending: bool, small_target: int, max_freq: int) -> Self: ...
