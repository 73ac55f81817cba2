"""Settings written as text in vLLM's and SGLang's extra-config: a number read one way for
every key (as the command line reads it), and admission parameters named once each."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.integrations.sglang.settings import parse_settings as parse_sglang
from kvoffload.integrations.vllm.secondary_settings import (
    parse_disk_settings,
    parse_shared_settings,
)
from kvoffload.integrations.vllm.settings import parse_settings as parse_vllm

DISK = "/nvme/kv"


def _vllm(disk_bytes: object, timeout_ms: object = 5) -> tuple[int, float]:
    settings = parse_vllm(
        {
            "cpu_bytes_to_use": 1 << 20,
            "kvoffload.disk_dir": DISK,
            "kvoffload.disk_bytes": disk_bytes,
            "kvoffload.disk_timeout_ms": timeout_ms,
        }
    )
    return settings.disk_bytes, settings.disk_timeout_ms / 1000


def _sglang(disk_bytes: object, timeout_ms: object = 5) -> tuple[int, float]:
    settings = parse_sglang(
        {
            "kvoffload.disk_dir": DISK,
            "kvoffload.disk_bytes": disk_bytes,
            "kvoffload.disk_timeout_ms": timeout_ms,
        }
    )
    assert settings.disk_deadline_s is not None
    return settings.disk_bytes, settings.disk_deadline_s


def _secondary(disk_bytes: object, timeout_ms: object = 5) -> tuple[int, float]:
    entry = {"disk_dir": DISK, "disk_bytes": disk_bytes, "disk_timeout_ms": timeout_ms}
    settings = parse_disk_settings("KVOffloadDiskTier", entry)
    assert settings.tier.deadline_s is not None
    return settings.capacity_bytes, settings.tier.deadline_s


PARSERS: dict[str, Callable[..., tuple[int, float]]] = {
    "vllm": _vllm,
    "sglang": _sglang,
    "vllm-secondary": _secondary,
}


@pytest.mark.parametrize("parse", PARSERS.values(), ids=PARSERS.keys())
def test_a_size_and_a_timeout_take_underscores_alike(
    parse: Callable[..., tuple[int, float]],
) -> None:
    """``disk_timeout_ms: "1_000"`` was taken (``float()`` reads it) and ``disk_bytes:
    "1_000_000"`` refused as no integer: one key read as the command line reads numbers,
    the next not."""
    assert parse("1_000_000", "1_000") == (1_000_000, 1.0)
    assert parse(" 1000000 ", "1000") == (1_000_000, 1.0)


@pytest.mark.parametrize("text", ["²", "--5", "1__000", "_1000", "1000_", "1e6", "0x10"])
@pytest.mark.parametrize("parse", PARSERS.values(), ids=PARSERS.keys())
def test_text_that_is_no_integer_is_one_line_naming_the_key(
    parse: Callable[..., tuple[int, float]], text: str
) -> None:
    """``"²"`` passed an ``isdigit()`` test and failed in ``int()``, and vLLM's ``"--5"``
    passed its ``lstrip("-")``: a bare ``ValueError`` that named no key."""
    with pytest.raises(InvalidArgumentError) as error:
        parse(text)
    message = str(error.value)
    assert "disk_bytes" in message and repr(text) in message and "\n" not in message


@pytest.mark.parametrize("text", ["1__000", "_1000", "1000_", "1_e3"])
@pytest.mark.parametrize("parse", PARSERS.values(), ids=PARSERS.keys())
def test_a_timeout_with_underscores_out_of_place_is_refused(
    parse: Callable[..., tuple[int, float]], text: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=r"disk_timeout_ms.* must be a number"):
        parse(1 << 20, text)


DUPLICATED = '{"threshold": 3, "threshold": 5}'

ADMISSION_ENTRIES: dict[str, tuple[Callable[[Mapping[str, Any]], object], dict[str, Any]]] = {
    "vllm": (
        parse_vllm,
        {
            "cpu_bytes_to_use": 1 << 20,
            "kvoffload.admission": "sketch",
            "kvoffload.admission_params": DUPLICATED,
        },
    ),
    "sglang": (
        parse_sglang,
        {
            "kvoffload.disk_dir": DISK,
            "kvoffload.disk_bytes": 1 << 20,
            "kvoffload.disk_admission": "sketch",
            "kvoffload.disk_admission_params": DUPLICATED,
        },
    ),
    "vllm-secondary": (
        lambda entry: parse_disk_settings("KVOffloadDiskTier", entry),
        {
            "disk_dir": DISK,
            "disk_bytes": 1 << 20,
            "admission": "sketch",
            "admission_params": DUPLICATED,
        },
    ),
}


@pytest.mark.parametrize(("parse", "config"), ADMISSION_ENTRIES.values(), ids=ADMISSION_ENTRIES)
def test_a_parameter_named_twice_in_json_is_refused_naming_it(
    parse: Callable[[Mapping[str, Any]], object], config: dict[str, Any]
) -> None:
    """JSON keeps the last of two equal names silently: the 3 written first went unused."""
    with pytest.raises(InvalidArgumentError) as error:
        parse(config)
    message = str(error.value)
    assert "admission_params" in message and "\n" not in message
    assert "gives admission parameter 'threshold' twice" in message


@pytest.mark.parametrize("blank", [" ", "\n", "\t "])
@pytest.mark.parametrize(
    ("parse", "key"),
    [
        (lambda key, v: parse_vllm({"cpu_bytes_to_use": 1 << 20, key: v}), "kvoffload.disk_dir"),
        (lambda key, v: parse_vllm({"cpu_bytes_to_use": 1 << 20, key: v}), "kvoffload.remote_url"),
        (
            lambda key, v: parse_sglang({key: v, "kvoffload.disk_bytes": 1 << 20}),
            "kvoffload.disk_dir",
        ),
        (lambda key, v: parse_sglang({key: v}), "kvoffload.remote_url"),
    ],
    ids=["vllm-disk", "vllm-remote", "sglang-disk", "sglang-remote"],
)
def test_a_blank_directory_or_url_is_refused_naming_its_key(
    parse: Callable[[str, str], object], key: str, blank: str
) -> None:
    """A blank value (a template's empty line) opened a disk tier in a directory named by
    spaces inside the engine's working directory, as the secondary tiers already refuse."""
    with pytest.raises(InvalidArgumentError, match=rf"'{key}' must be a non-blank string"):
        parse(key, blank)


@pytest.mark.parametrize("key", ["eviction_policy", "kvoffload.admission"])
def test_a_pasted_policy_or_admission_name_is_shown_cut(key: str) -> None:
    """A name of 100,000 characters was echoed whole: one error line of 100 kB."""
    with pytest.raises(InvalidArgumentError, match=r"\(100,002 characters\)") as error:
        parse_vllm({"cpu_bytes_to_use": 1 << 20, key: "x" * 100_000})
    assert len(str(error.value)) < 1_000


def test_a_password_source_is_read_by_no_settings_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM builds its spec in every worker too, whose environment (Ray copies only some
    variables) may lack the variable: only the process that opens the tier reads it."""
    monkeypatch.delenv("KVO_UNSET_PASSWORD", raising=False)
    url = "redis://cache:6379/0?password_env=KVO_UNSET_PASSWORD"
    assert parse_vllm({"cpu_bytes_to_use": 1 << 20, "kvoffload.remote_url": url})
    assert parse_sglang({"kvoffload.remote_url": url})
    assert parse_shared_settings("KVOffloadSharedTier", {"url": url, "admission": "none"})
