"""The backend's extra-config keys, checked without SGLang: every bad key or value is named."""

from __future__ import annotations

import re
from typing import Any

import pytest
from sglang_helpers import BAD_CONFIGS

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.integrations.sglang.settings import BackendSettings, parse_settings


def test_a_full_configuration_is_read_as_given() -> None:
    settings = parse_settings(
        {
            "backend_name": "kvoffload",
            "module_path": "kvoffload.integrations.sglang",
            "class_name": "KVOffloadStorage",
            "interface_v1": 1,
            "hicache_storage_pass_prefix_keys": True,
            "kvoffload.disk_dir": "/nvme/l3",
            "kvoffload.disk_bytes": "4096",
            "kvoffload.disk_policy": "arc",
            "kvoffload.disk_admission": "recommended",
            "kvoffload.disk_timeout_ms": "2500",
            "kvoffload.remote_url": "redis://a:1,b:2?timeout_ms=50",
            "kvoffload.remote_admission": "sketch",
            "kvoffload.remote_bytes": 10**9,
            "kvoffload.kv_events_endpoint": "tcp://*:5557",
            "kvoffload.metrics_port": 0,
        }
    )
    assert settings == BackendSettings(
        interface_v1=True,
        disk_dir="/nvme/l3",
        disk_bytes=4096,
        disk_policy="arc",
        disk_admission="recommended",
        disk_deadline_s=2.5,
        remote_url="redis://a:1,b:2?timeout_ms=50",
        remote_admission="sketch",
        remote_bytes=10**9,
        kv_events_endpoint="tcp://*:5557",
        metrics_port=0,
    )


@pytest.mark.parametrize("extra,named", BAD_CONFIGS)
def test_every_bad_key_or_value_is_named(extra: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(named)):
        parse_settings(extra)


def test_a_size_json_spells_as_a_whole_float_is_taken_as_vllm_takes_it() -> None:
    """``--hicache-storage-backend-extra-config '{"kvoffload.disk_bytes": 500e9}'`` gives
    JSON's float 500000000000.0: taken as vLLM's keys take it, a fraction still refused."""
    settings = parse_settings(
        {
            "kvoffload.disk_dir": "/nvme/l3",
            "kvoffload.disk_bytes": 500e9,
            "kvoffload.remote_url": "redis://a:1",
            "kvoffload.remote_bytes": 2e12,
        }
    )
    assert (settings.disk_bytes, settings.remote_bytes) == (500 * 10**9, 2 * 10**12)
    assert isinstance(settings.disk_bytes, int)
    with pytest.raises(InvalidArgumentError, match=re.escape("'kvoffload.disk_bytes'")):
        parse_settings({"kvoffload.disk_dir": "/nvme/l3", "kvoffload.disk_bytes": 4096.5})


def test_a_json_null_is_the_keys_default_as_sglang_reads_its_own_keys() -> None:
    """SGLang reads ``"interface_v1": null`` as its copy interface (``bool(get(key, 0))``);
    the backend stopped start-up on it ("must be 0 or 1, got None") and on a null
    ``kvoffload.remote_bytes``, though every other optional key's null was its default.
    Null is now the default for every key; a required key given as null is missing."""
    nulls = {
        "interface_v1": None,
        "kvoffload.remote_url": "redis://a:1",
        "kvoffload.remote_bytes": None,
        "kvoffload.metrics_port": None,
    }
    assert parse_settings(nulls) == BackendSettings(remote_url="redis://a:1")
    with pytest.raises(InvalidArgumentError, match=re.escape("'kvoffload.remote_bytes'")):
        parse_settings({**nulls, "kvoffload.remote_admission": "sketch"})
    with pytest.raises(InvalidArgumentError, match=re.escape("'kvoffload.disk_bytes' is missing")):
        parse_settings({"kvoffload.disk_dir": "/nvme/l3", "kvoffload.disk_bytes": None})
    with pytest.raises(InvalidArgumentError, match=r"unknown .* key 'kvoffload\.disk_byte'"):
        parse_settings({**nulls, "kvoffload.disk_byte": None})


TOML_FILE = """
backend_name = "kvoffload"
module_path = "kvoffload.integrations.sglang"
class_name = "KVOffloadStorage"
interface_v1 = 1
kvoffload.disk_dir = "/nvme/l3"
kvoffload.disk_bytes = 4_096
kvoffload.disk_admission = "recommended"
kvoffload.disk_admission_params = { switch_margin = 0.5 }
"""


def test_a_toml_files_dotted_keys_are_read_as_the_keys_they_spell() -> None:
    """SGLang reads ``--hicache-storage-backend-extra-config @l3.toml`` (and ``.yaml``) too,
    and TOML makes ``kvoffload.disk_dir = ...`` a ``kvoffload`` table, as a YAML file
    nesting the keys under ``kvoffload:`` does: start-up was refused ('unknown key
    'kvoffload'') for the documented keys. The table is read as the keys it spells; a key
    given both ways is refused, naming it."""
    import tomllib

    read = parse_settings(tomllib.loads(TOML_FILE))
    dotted = parse_settings(
        {
            "interface_v1": 1,
            "kvoffload.disk_dir": "/nvme/l3",
            "kvoffload.disk_bytes": 4096,
            "kvoffload.disk_admission": "recommended",
            "kvoffload.disk_admission_params": {"switch_margin": 0.5},
        }
    )
    assert read == dotted and read.disk_dir == "/nvme/l3" and read.disk_bytes == 4096
    twice = {"kvoffload.disk_dir": "/a", "kvoffload": {"disk_dir": "/b", "disk_bytes": 9}}
    with pytest.raises(
        InvalidArgumentError, match=re.escape("'kvoffload.disk_dir' is given twice")
    ):
        parse_settings(twice)
    with pytest.raises(InvalidArgumentError, match=r"unknown .* key 'kvoffload\.disk_byte'"):
        parse_settings({"kvoffload": {"disk_dir": "/a", "disk_byte": 9}})
