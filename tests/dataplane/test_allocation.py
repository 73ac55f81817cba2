"""Bad devices and oversized buffers are one clear error, not a torch traceback."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvoffload.cli.main import main  # noqa: E402
from kvoffload.core.errors import InsufficientMemoryError, InvalidArgumentError  # noqa: E402
from kvoffload.core.layout import layout_preset  # noqa: E402
from kvoffload.dataplane import CPUBlockStore, PagedKVCache  # noqa: E402
from kvoffload.dataplane.allocation import (  # noqa: E402
    allocate,
    check_device_present,
    resolve_device,
)

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def test_cpu_resolves() -> None:
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["foo", "cpu:x", "meta"])
def test_unknown_or_unsupported_device(name: str) -> None:
    with pytest.raises(InvalidArgumentError, match="device"):
        resolve_device(name)


@NO_CUDA
def test_cuda_without_cuda_is_an_input_error() -> None:
    with pytest.raises(InvalidArgumentError, match="sees no CUDA device"):
        PagedKVCache(layout_preset("tiny"), 4, "cuda")


@pytest.mark.parametrize(
    ("cuda_devices", "present"),
    [
        (0, "no CUDA device"),
        (1, "1 CUDA device (cuda:0)"),
        (3, "3 CUDA devices (cuda:0 to cuda:2)"),
    ],
)
def test_a_cuda_index_past_the_gpus_present_is_one_line_naming_their_count(
    cuda_devices: int, present: str
) -> None:
    """cuda:3 on a 1-GPU machine was taken, and the first allocation there failed with
    CUDA's "invalid device ordinal", reported as too little memory."""
    with pytest.raises(InvalidArgumentError) as refused:
        check_device_present(torch.device("cuda:3"), cuda_devices)
    assert str(refused.value) == f"device 'cuda:3' asked for, but torch sees {present}"


@pytest.mark.parametrize("visible", ["3", "GPU-5f2a,1", ""])
def test_a_cuda_index_past_the_visible_gpus_names_cuda_visible_devices(visible: str) -> None:
    """Under CUDA_VISIBLE_DEVICES=3 the machine's GPU 3 is torch's cuda:0: an operator who
    asked for cuda:3 was told only that torch sees one device."""
    with pytest.raises(InvalidArgumentError) as refused:
        check_device_present(torch.device("cuda:3"), 1, visible)
    assert str(refused.value) == (
        "device 'cuda:3' asked for, but torch sees 1 CUDA device (cuda:0); "
        f"CUDA_VISIBLE_DEVICES={visible!r} is set: torch sees only the GPUs it lists, "
        "numbered from cuda:0"
    )


@NO_CUDA
def test_cuda_hidden_by_cuda_visible_devices_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty CUDA_VISIBLE_DEVICES hides every GPU: the refusal blamed the torch build."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(InvalidArgumentError, match=r"no CUDA device; CUDA_VISIBLE_DEVICES='' is"):
        resolve_device("cuda:0")


@pytest.mark.parametrize(
    ("device", "cuda_devices"), [("cuda:0", 1), ("cuda", 1), ("cuda:3", 4), ("cpu", 0)]
)
def test_a_device_the_machine_has_is_taken(device: str, cuda_devices: int) -> None:
    check_device_present(torch.device(device), cuda_devices)


@NO_CUDA
def test_a_pinned_cpu_store_without_cuda_is_an_input_error() -> None:
    with pytest.raises(InvalidArgumentError, match="pin_memory=True needs CUDA"):
        CPUBlockStore(layout_preset("tiny"), 4, pin_memory=True)


def test_a_buffer_too_big_for_memory_names_its_size() -> None:
    with pytest.raises(InsufficientMemoryError, match=r"cannot allocate 1048576\.0 GiB for test"):
        allocate((2**50,), torch.uint8, torch.device("cpu"), "test")
    with pytest.raises(MemoryError):  # the builtin base works too
        CPUBlockStore(layout_preset("llama-3.1-8b"), 2**30)


@pytest.mark.parametrize("num_blocks", [2**63, 10**19, 10**30])
def test_a_block_count_past_torchs_sizes_is_a_buffer_too_big(num_blocks: int) -> None:
    """bench transfer --gpu-blocks 10000000000000000000 once ended in torch's TypeError
    (a size past int64) and a traceback."""
    layout = layout_preset("tiny")
    for build in (CPUBlockStore, PagedKVCache):
        with pytest.raises(InsufficientMemoryError, match=r"cannot allocate .* GiB"):
            build(layout, num_blocks)


def test_the_cli_reports_a_gpu_cache_past_torchs_sizes_in_one_line_naming_the_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["bench", "transfer", "--layout", "tiny", "--gpu-blocks", str(10**19)]
    assert main([*args, "--cpu-blocks", "8", "--no-progress"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"kvoffload: error: --gpu-blocks {10**19} (a paged KV cache of ")


@NO_CUDA
def test_cli_reports_a_missing_device_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--data-plane", "--device", "cuda", "--requests", "5", "--no-progress"]
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "kvoffload: error: --device cuda: device 'cuda' asked for, but this torch build sees "
        "no CUDA device"
    ]


def test_a_strided_buffer_for_the_cpu_store_is_an_input_error() -> None:
    """It was taken, and building a handler on the store then failed deep in torch
    ("stride(-1) must be 1 to view Byte as ComplexDouble")."""
    layout = layout_preset("tiny")
    every_other_byte = torch.zeros(2 * 4 * layout.bytes_per_block, dtype=torch.uint8)[::2]
    with pytest.raises(InvalidArgumentError, match=r"must be contiguous, got strides \(2,\)"):
        CPUBlockStore(layout, 4, buffer=every_other_byte)


@pytest.mark.parametrize("value", [0, 2.5, "3", True, None])
@pytest.mark.parametrize(
    ("build", "name"),
    [
        (lambda n: PagedKVCache(layout_preset("tiny"), n), "num_blocks"),
        (lambda n: CPUBlockStore(layout_preset("tiny"), n, pin_memory=False), "num_blocks"),
        (
            lambda n: CPUBlockStore(layout_preset("tiny"), 2, n, pin_memory=False),
            "block_size_factor",
        ),
    ],
    ids=["kv-cache", "store", "store-factor"],
)
def test_a_block_count_that_is_no_positive_int_is_one_line_naming_it(
    build: Callable[[object], object], name: str, value: object
) -> None:
    """A float or a string once reached torch (a TypeError from deep inside), and True was
    taken as a factor of 1."""
    with pytest.raises(InvalidArgumentError, match=rf"^{name} must be an int >= 1, got {value!r}$"):
        build(value)


def test_numpy_block_counts_are_taken_as_ints() -> None:
    store = CPUBlockStore(layout_preset("tiny"), np.int64(3), np.int32(2), pin_memory=False)
    assert (store.num_blocks, store.block_size_factor) == (3, 2)
    assert type(store.slot_bytes) is int
