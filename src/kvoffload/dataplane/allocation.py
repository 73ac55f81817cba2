"""Device parsing and buffer allocation that fail with a sentence, not a torch traceback.

The data plane's buffers are sized by the operator (layout x blocks), so a
typo in a device name or a capacity that does not fit in memory is an input
error worth one clear line.
"""

from __future__ import annotations

import math
import operator
import os
from typing import SupportsIndex

import torch

from kvoffload.core.errors import InsufficientMemoryError, InvalidArgumentError


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device, checked to be a CPU or a usable CUDA device."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(f"unknown device {device!r}: {exc}") from None
    if resolved.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"device {device!r}: only cpu and cuda devices are supported")
    if resolved.type == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if not torch.cuda.is_available():
            raise InvalidArgumentError(
                f"device {device!r} asked for, but this torch build sees no CUDA device"
                f"{_visible_note(visible)}"
            )
        check_device_present(resolved, torch.cuda.device_count(), visible)
    return resolved


def check_device_present(
    device: torch.device, cuda_devices: int, visible_devices: str | None = None
) -> None:
    """Refuse ``cuda:N`` on a machine of ``cuda_devices`` GPUs that has no GPU N.

    torch takes the name, and the first allocation there failed deep inside (CUDA's
    "invalid device ordinal", which :func:`allocate` then reported as memory too small).
    ``visible_devices``: ``CUDA_VISIBLE_DEVICES`` where set, named in the refusal, as it
    renumbers the GPUs from 0 (``cuda:3`` of ``nvidia-smi`` may be torch's ``cuda:0``).
    """
    if device.type != "cuda" or device.index is None or device.index < cuda_devices:
        return
    if cuda_devices == 0:
        present = "no CUDA device"
    elif cuda_devices == 1:
        present = "1 CUDA device (cuda:0)"
    else:
        present = f"{cuda_devices} CUDA devices (cuda:0 to cuda:{cuda_devices - 1})"
    raise InvalidArgumentError(
        f"device '{device}' asked for, but torch sees {present}{_visible_note(visible_devices)}"
    )


def _visible_note(visible_devices: str | None) -> str:
    if visible_devices is None:
        return ""
    return (
        f"; CUDA_VISIBLE_DEVICES={visible_devices!r} is set: torch sees only the GPUs it "
        "lists, numbered from cuda:0"
    )


def block_count(name: str, value: object) -> int:
    """``value`` as an int >= 1 (NumPy's integers too), or one line naming ``name``: a
    float or a string reached torch as a ``TypeError`` from deep inside."""
    count = -1
    if isinstance(value, SupportsIndex) and not isinstance(value, bool):
        count = operator.index(value)
    if count < 1:
        raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
    return count


def allocate(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    what: str,
    *,
    zero: bool = False,
) -> torch.Tensor:
    """A new tensor for ``what``; :class:`InsufficientMemoryError` if it does not fit."""
    num_bytes = math.prod(shape) * dtype.itemsize
    if num_bytes > _MAX_BYTES:  # torch would refuse the sizes with a TypeError
        raise _does_not_fit(num_bytes, what, device)
    make = torch.zeros if zero else torch.empty
    try:
        return make(shape, dtype=dtype, device=device)
    except RuntimeError:  # torch.OutOfMemoryError is a RuntimeError too
        raise _does_not_fit(num_bytes, what, device) from None


_MAX_BYTES = 2**63 - 1
"""torch's sizes are int64: no tensor has more bytes (and no machine that much memory)."""


def _does_not_fit(num_bytes: int, what: str, device: torch.device) -> InsufficientMemoryError:
    return InsufficientMemoryError(
        f"cannot allocate {num_bytes / 2**30:.1f} GiB for {what} on {device}: not enough "
        "memory; use a smaller KV layout or fewer blocks"
    )
