"""One check per lower-tier setting: the same bad value gives the builder's own one-line error
(:class:`LowerTierConfig`'s) from the simulator's configuration, the vLLM spec, SGLang's
extra-config and a vLLM secondary-tier entry, each naming its own key."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from kvoffload.core.errors import InsufficientMemoryError, InvalidArgumentError
from kvoffload.integrations.sglang.paths import L3_SPEC
from kvoffload.integrations.sglang.settings import parse_settings as parse_sglang
from kvoffload.integrations.vllm.secondary_settings import (
    parse_disk_settings,
    parse_shared_settings,
)
from kvoffload.integrations.vllm.settings import parse_settings as parse_spec
from kvoffload.managers.stack import LowerTierConfig, StackConfig
from kvoffload.tiers.slot_file import footprint
from kvoffload.tiers.stack import tier_book

DISK_ENTRY = {"disk_dir": "/nvme/kv", "disk_bytes": 1 << 20}
SHARED_ENTRY = {"url": "redis://127.0.0.1:6379/0", "remote_bytes": 1 << 20}
SHARED_SGLANG = {"kvoffload.remote_url": "redis://127.0.0.1:6379/0"}

Caller = tuple[Callable[[], object], str, Mapping[str, str]]
"""What raises, the prefix its errors start with, and its keys by the builder's field names."""


def _simulator(**fields: Any) -> Caller:
    config = {"disk_dir": "/nvme/kv", "disk_blocks": 16, **fields}
    fields = ("policy", "admission", "write_budget")
    return (lambda: StackConfig(8, **config)), "", {field: f"disk_{field}" for field in fields}


def _secondary(kind: str, **entry: Any) -> Caller:
    parse, base = (
        (parse_disk_settings, DISK_ENTRY)
        if kind == "disk"
        else (parse_shared_settings, SHARED_ENTRY)
    )
    tier_type = "KVOffloadDiskTier" if kind == "disk" else "KVOffloadSharedTier"
    names = {"policy": "'eviction_policy'", "admission": "'admission'"}
    names.update(write_budget="'write_budget'", admission_params="'admission_params'")
    return (
        (lambda: parse(tier_type, {**base, **entry})),
        f"secondary tier {tier_type!r} ",
        {field: f"key {key}" for field, key in names.items()},
    )


def _sglang(kind: str, **keys: Any) -> Caller:
    base = (
        {"kvoffload.disk_dir": "/nvme/kv", "kvoffload.disk_bytes": 1 << 20}
        if kind == "disk"
        else {"kvoffload.remote_url": SHARED_ENTRY["url"], "kvoffload.remote_bytes": 1 << 20}
    )
    extra = {**base, **{f"kvoffload.{kind}_{key}": value for key, value in keys.items()}}
    fields = ("policy", "admission", "write_budget", "admission_params")
    return (
        (lambda: parse_sglang(extra)),
        "hicache-storage-backend-extra-config ",
        {field: f"'kvoffload.{kind}_{field}'" for field in fields},
    )


def _spec(kind: str, **keys: Any) -> Caller:
    base: dict[str, Any] = {"cpu_bytes_to_use": 1 << 20}
    if kind == "disk":
        base.update({"kvoffload.disk_dir": "/nvme/kv", "kvoffload.disk_bytes": 1 << 20})
    else:
        base.update({"kvoffload.remote_url": SHARED_ENTRY["url"], "kvoffload.remote_bytes": 4096})
    extra = {**base, **{f"kvoffload.{kind}_{key}": value for key, value in keys.items()}}
    return (
        (lambda: parse_spec(extra)),
        "kv_connector_extra_config ",
        {field: f"'kvoffload.{kind}_{field}'" for field in ("admission", "write_budget")},
    )


def _builders_words(caller: Caller) -> str:
    """The caller's error with its prefix and keys put back as the builder's field names."""
    build, prefix, names = caller
    with pytest.raises(InvalidArgumentError) as error:
        build()
    message = str(error.value)
    assert message.startswith(prefix), message
    assert "\n" not in message
    message = message.removeprefix(prefix)
    for field, key in sorted(names.items(), key=lambda item: -len(item[1])):
        message = message.replace(key, field)
    return message


CASES = {
    "a write budget without the optimiser": (
        {"admission": "feedback", "write_budget": 0.1},
        [
            _simulator(disk_admission="feedback", disk_write_budget=0.1),
            _spec("disk", admission="feedback", write_budget=0.1),
            _spec("remote", admission="feedback", write_budget=0.1),
            _sglang("disk", admission="feedback", write_budget="0.1"),
            _sglang("remote", admission="feedback", write_budget="0.1"),
            _secondary("disk", admission="feedback", write_budget=0.1),
            _secondary("remote", admission="feedback", write_budget=0.1),
        ],
    ),
    "an unknown eviction policy": (
        {"policy": "fifo-ish"},
        [
            _simulator(disk_policy="fifo-ish"),
            _sglang("disk", policy="fifo-ish"),
            _secondary("disk", eviction_policy="fifo-ish"),
        ],
    ),
    "an unknown admission": (
        {"admission": "bogus"},
        [
            _simulator(disk_admission="bogus"),
            _spec("disk", admission="bogus"),
            _spec("remote", admission="bogus"),
            _sglang("disk", admission="bogus"),
            _sglang("remote", admission="bogus"),
            _secondary("disk", admission="bogus"),
            _secondary("remote", admission="bogus"),
        ],
    ),
    "an out-of-range admission parameter": (
        {"admission": "sketch", "admission_params": {"threshold": 99}},
        [
            _sglang("disk", admission="sketch", admission_params={"threshold": 99}),
            _sglang("remote", admission="sketch", admission_params={"threshold": 99}),
            _secondary("disk", admission="sketch", admission_params={"threshold": 99}),
            _secondary("remote", admission="sketch", admission_params='{"threshold": 99}'),
        ],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_tier_setting_gives_the_builders_error_naming_each_callers_key(case: str) -> None:
    fields, callers = CASES[case]
    with pytest.raises(InvalidArgumentError) as builders:
        LowerTierConfig("disk", "/nvme/kv", 16, **fields)
    expected = str(builders.value)
    for caller in callers:
        assert _builders_words(caller) == expected


def test_the_secondary_entry_holds_the_builders_config_sized_when_the_chunk_is_known() -> None:
    entry = {
        **DISK_ENTRY,
        "eviction_policy": "arc",
        "admission": "recommended",
        "write_budget": "1dwpd",
        "io_threads": "3",
        "fsync": True,
        "disk_timeout_ms": 2500,
    }
    settings = parse_disk_settings("KVOffloadDiskTier", entry)
    assert settings.tier.blocks is None  # the chunk size is vLLM's, known when the tier opens
    sized = settings.sized(4096)
    # The full slot file, not the payloads, fits in disk_bytes: a 4 KiB block's slot takes
    # 8 KiB (header, key, alignment), so 1 MiB holds 127 after the superblock, not 256.
    assert footprint(127, 4096) <= 1 << 20 < footprint(128, 4096)
    assert sized == LowerTierConfig(
        "disk",
        "/nvme/kv",
        127,
        "arc",
        2.5,
        "recommended",
        write_budget=sized.write_budget,
        io_threads=3,
        fsync=True,
    )
    assert sized.write_budget is not None
    assert (sized.write_budget.block_bytes, sized.write_budget.drive_bytes) == (4096, 1 << 20)
    with pytest.raises(InvalidArgumentError, match=r"^secondary tier 'T' key 'disk_bytes': 1000 "):
        parse_disk_settings("T", {**DISK_ENTRY, "disk_bytes": 1000}).sized(4096)
    unbounded = parse_shared_settings("S", {"url": SHARED_ENTRY["url"], "admission": "none"})
    assert unbounded.sized(4096).blocks == 0


def test_a_secondary_write_budget_reaches_the_builders_optimiser() -> None:
    from kvoffload.admission import OptimisingAdmission
    from kvoffload.core.specs import CPULoadStoreSpec
    from kvoffload.tiers.stack import tier_book

    settings = parse_disk_settings("KVOffloadDiskTier", {**DISK_ENTRY, "write_budget": "0.2"})
    layer = tier_book(settings.sized(4096), CPULoadStoreSpec([]))
    assert isinstance(layer, OptimisingAdmission)
    assert layer.capacity == 127 and layer.objective.write_budget == 0.2  # 8 KiB slots


@pytest.mark.parametrize(
    ("parse", "entry"), [(parse_disk_settings, DISK_ENTRY), (parse_shared_settings, SHARED_ENTRY)]
)
def test_an_unknown_secondary_tier_key_lists_every_key_the_entry_takes(
    parse: Callable[[str, Mapping[str, Any]], object], entry: Mapping[str, Any]
) -> None:
    """The known keys include those vLLM's own tiering reads, which the entry accepts."""
    with pytest.raises(InvalidArgumentError, match="'disk_dri': unknown key") as error:
        parse("T", {**entry, "disk_dri": "/x"})
    assert all(key in str(error.value) for key in ("type", "module_path", "backpressure"))
    parse("T", {**entry, "type": "T", "module_path": "m", "backpressure": True})


@pytest.mark.parametrize(
    ("parse", "named"),
    [
        (lambda: parse_sglang({**SHARED_SGLANG, None: 1, "kvoffload.typo": 2}), "'kvoffload.typo'"),
        (lambda: parse_spec({"cpu_bytes_to_use": 1 << 20, None: 1, "typo": 2}), "'typo'"),
        (lambda: parse_disk_settings("disk", {**DISK_ENTRY, 3: 1, "typo": 2}), "'typo'"),
        (lambda: parse_shared_settings("t", {**SHARED_ENTRY, None: 1, "typo": 2}), "'typo'"),
    ],
)
def test_unknown_keys_of_mixed_types_are_named(parse: Callable[[], object], named: str) -> None:
    """A mapping built in Python may hold a key that is not a string beside string keys:
    still the one error naming a key (a TypeError from sorting them before)."""
    with pytest.raises(InvalidArgumentError, match=f"key {named}"):
        parse()


@pytest.mark.parametrize(
    ("tier", "named"),
    [
        (
            lambda: (
                parse_sglang(
                    {
                        **SHARED_SGLANG,
                        "kvoffload.remote_admission": "sketch",
                        "kvoffload.remote_bytes": 1,
                    }
                ).remote_tier
            ),
            "hicache-storage-backend-extra-config 'kvoffload.remote_bytes': ",
        ),
        (
            lambda: parse_disk_settings("disk", DISK_ENTRY).tier,
            "secondary tier 'disk' key 'disk_bytes': ",
        ),
    ],
)
def test_a_size_whose_admission_memory_the_machine_lacks_names_its_key(
    tier: Callable[[], LowerTierConfig | None], named: str
) -> None:
    """A tier size the admission layer cannot keep a sketch of stops start-up naming the
    size's key (before: only 'an admission frequency sketch of ... sightings')."""
    config = tier()
    assert config is not None
    with pytest.raises(InsufficientMemoryError, match=re.escape(named)):
        tier_book(dataclasses.replace(config, blocks=10**30), L3_SPEC)
