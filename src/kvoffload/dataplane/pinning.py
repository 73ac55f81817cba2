"""Page-locking host memory the data plane already holds, byte for byte.

torch's pinned allocator (``pin_memory=True``) rounds every allocation up to
a power of two, so a 40 GB CPU tier would lock 64 GB of RAM (pytorch#95823,
#150517). Registering memory with ``cudaHostRegister`` locks exactly the
bytes asked for. A refused registration leaves copies correct, only
synchronous, and must not leave its error behind for the engine's next kernel.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from kvoffload.core.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


def wants_pinning(pin: bool | None, argument: str) -> bool:
    """Whether to pin: ``pin``, or where it is ``None`` whether torch sees a CUDA device;
    an explicit request without CUDA is an input error (``argument`` names it), raised
    before anything is allocated."""
    available = torch.cuda.is_available()
    if pin and not available:
        raise InvalidArgumentError(f"{argument}=True needs CUDA, and torch sees no CUDA device")
    return available if pin is None else pin


def _cudart() -> Any:
    """torch's CUDA runtime bindings (untyped)."""
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _consume_cuda_error() -> None:
    """Clear the error a failed CUDA runtime call leaves behind.

    The runtime keeps it until it is read, and torch reads it after its next
    kernel launch, which then fails in the engine's code (seen on an H200 after
    a refused ``cudaHostRegister``). A one-element launch of ours reads it first.
    """
    with contextlib.suppress(RuntimeError):
        torch.zeros(1, device="cuda")


def register(tensor: torch.Tensor, what: str) -> int:
    """Page-lock the bytes of ``tensor`` (contiguous, on the CPU) so that GPU copies run
    asynchronously; the registered address, or 0 with a warning if CUDA refuses."""
    address = tensor.data_ptr()
    error = int(_cudart().cudaHostRegister(address, tensor.numel() * tensor.element_size(), 0))
    if error != 0:
        _consume_cuda_error()
        logger.warning(
            "kvoffload: cannot pin %s (cudaHostRegister error %d; CUDA pins memory and files "
            "in memory, such as /dev/shm's, not files on disk, and within the memlock limit); "
            "GPU copies will be synchronous",
            what,
            error,
        )
        return 0
    return address


def unregister(address: int) -> None:
    """Undo :func:`register` (0: nothing was registered)."""
    if address and int(_cudart().cudaHostUnregister(address)) != 0:
        _consume_cuda_error()
