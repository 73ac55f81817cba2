"""The engine pages' tables of keys and lists of metrics, against the code an operator runs.

An operator copies a key or a metric name from docs/sglang.md, docs/vllm.md or
docs/vllm-secondary.md: a key added, renamed or dropped in the code without its page (or
the reverse), a default changed, or a counter exported under another name, fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvoffload.tiers.disk import DEFAULT_TIMEOUT_MS
from kvoffload.tiers.url import DEFAULT_TIMEOUT_MS as URL_TIMEOUT_MS

DOCS = Path(__file__).parents[2] / "docs"


def _table_rows(page: str, header: str) -> list[list[str]]:
    """The cells of each row of the table under the header line ``header`` of ``page``."""
    text = (DOCS / page).read_text()
    lines = text[text.index(header) :].splitlines()[2:]  # past the header and its rule
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _url_timeout_ms(cell: str) -> float:
    """The default of the URL's ``?timeout_ms=`` as a key's cell gives it."""
    found = re.search(r"`\?timeout_ms=` \(default (\d+)\)", cell)
    assert found is not None, cell
    return float(found.group(1))


def test_sglang_pages_keys_and_defaults_are_the_backends() -> None:
    from kvoffload.integrations.sglang.settings import (
        OWN_KEYS,
        SGLANG_KEYS,
        parse_settings,
    )

    rows = _table_rows("sglang.md", "| key | value | default |")
    documented = {_ticked(key)[0]: default for key, _, default in rows}
    values = {_ticked(key)[0]: value for key, value, _ in rows}
    assert set(documented) == OWN_KEYS
    text = (DOCS / "sglang.md").read_text()
    start = text.index("not one of\nSGLang's own")
    sglangs = text[start : text.index("stops start-up", start)]
    assert set(_ticked(sglangs)) == SGLANG_KEYS
    settings = parse_settings({"kvoffload.disk_dir": "/l3", "kvoffload.disk_bytes": 1})
    parsed = {
        "kvoffload.disk_policy": settings.disk_policy,
        "kvoffload.disk_admission": settings.disk_admission,
        "kvoffload.remote_admission": settings.remote_admission,
        # Unset, the tier's own deadline: the one the page gives.
        "kvoffload.disk_timeout_ms": f"{DEFAULT_TIMEOUT_MS:.0f}"
        if settings.disk_deadline_s is None
        else f"{settings.disk_deadline_s * 1000:.0f}",
    }
    assert {key: _ticked(documented[key])[0] for key in parsed} == parsed
    assert _url_timeout_ms(values["kvoffload.remote_url"]) == URL_TIMEOUT_MS


def test_sglang_pages_l3_counters_are_the_ones_exported() -> None:
    pytest.importorskip("prometheus_client")
    from kvoffload.integrations.sglang.metrics import COUNTER_DOCS, NAME

    text = (DOCS / "sglang.md").read_text()
    listed = text[text.index(f"`{NAME}<counter>_total`") : text.index("and the gauge")]
    counters = listed[listed.index(" for `") :]
    assert set(re.findall(r"`([a-z_]+)`", counters)) == set(COUNTER_DOCS)


def test_vllm_pages_keys_are_the_specs() -> None:
    from kvoffload.integrations.vllm.settings import OWN_KEYS, SPEC_KEYS

    rows = _table_rows("vllm.md", "| key | default |")
    documented = {key for cells in rows for key in _ticked(cells[0])}
    assert documented == OWN_KEYS | SPEC_KEYS


def test_secondary_pages_entry_keys_and_defaults_are_the_tiers() -> None:
    pytest.importorskip("vllm.v1.kv_offload.tiering.spec")  # vLLM 0.33's tiering
    from kvoffload.integrations.vllm.secondary import COUNTER_DOCS
    from kvoffload.integrations.vllm.secondary_settings import (
        DISK_KEYS,
        SHARED_KEYS,
        VLLM_KEYS,
        parse_disk_settings,
        parse_shared_settings,
    )

    rows = _table_rows("vllm-secondary.md", "| key | tier | default | meaning |")
    documented = {key: cells[2] for cells in rows for key in _ticked(cells[0])}
    assert set(documented) == DISK_KEYS | SHARED_KEYS | VLLM_KEYS
    disk = parse_disk_settings("KVOffloadDiskTier", {"disk_dir": "/d", "disk_bytes": 1})
    shared = parse_shared_settings(
        "KVOffloadSharedTier", {"url": "redis://h:1/0", "remote_bytes": 1}
    )
    deadline_s = disk.tier.deadline_s
    parsed = {
        "eviction_policy": disk.tier.policy,
        "fsync": str(disk.tier.fsync).lower(),
        "disk_timeout_ms": f"{DEFAULT_TIMEOUT_MS if deadline_s is None else deadline_s * 1000:.0f}",
        "admission": disk.admission,
        "offer_hits": str(disk.offer_hits).lower(),
        "io_threads": str(disk.tier.io_threads),
        "enable_kv_events": str(disk.enable_kv_events).lower(),
    }
    assert {key: _ticked(documented[key])[0] for key in parsed} == parsed
    assert (shared.admission, shared.locality, disk.locality) == ("recommended", "REMOTE", None)
    assert "shared: `REMOTE`" in documented["locality"]
    url_row = next(cells for cells in rows if _ticked(cells[0]) == ["url"])
    assert _url_timeout_ms(url_row[3]) == URL_TIMEOUT_MS

    text = (DOCS / "vllm-secondary.md").read_text()
    listed = re.search(r"`vllm:kvoffload_secondary_\{([a-z_,]+)\}`", text)
    assert listed is not None
    assert set(listed.group(1).split(",")) == set(COUNTER_DOCS)
