"""``kvoffload.disk_write_budget`` / ``kvoffload.remote_write_budget``: the optimiser of
SGLang's L3 tiers keeps the same budget strings as ``--write-budget``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvoffload.admission import OptimisingAdmission
from kvoffload.admission.budget import BYTES_PER_S, DWPD, PER_REF
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.integrations.sglang.settings import parse_settings
from kvoffload.tiers.slot_file import footprint

DISK = {"kvoffload.disk_dir": "/tmp/unused", "kvoffload.disk_bytes": 1 << 20}
OPTIMISER = {"kvoffload.disk_admission": "recommended"}


@pytest.mark.parametrize(
    ("budget", "unit"), [("0.2", PER_REF), (0.2, PER_REF), ("1MB/s", BYTES_PER_S), ("2dwpd", DWPD)]
)
def test_each_tier_takes_a_budget_in_any_unit(budget: str | float, unit: str) -> None:
    settings = parse_settings({**DISK, **OPTIMISER, "kvoffload.disk_write_budget": budget})
    assert settings.disk_write_budget is not None
    assert settings.disk_write_budget.unit == unit
    assert settings.remote_write_budget is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {**OPTIMISER, "kvoffload.disk_write_budget": "fast"},
            "'kvoffload.disk_write_budget': write budget: expected writes per block reference",
        ),
        (
            {**OPTIMISER, "kvoffload.disk_write_budget": "nan"},
            "'kvoffload.disk_write_budget': write budget: must be a finite number",
        ),
        (
            {"kvoffload.disk_write_budget": "0.1"},
            "'kvoffload.disk_write_budget' needs 'kvoffload.disk_admission' 'recommended'",
        ),
    ],
)
def test_a_bad_budget_is_named(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as error:
        parse_settings({**DISK, **extra})
    assert message in str(error.value)


def test_the_disk_tiers_optimiser_counts_its_pages_and_its_size_as_the_drive(
    backends: Any, tmp_path: Path
) -> None:
    pytest.importorskip("sglang", reason="SGLang is not installed (CI installs it --no-deps)")
    from sglang_helpers import HostPool

    pool = HostPool()
    page_bytes = len(pool.page_bytes(0))
    extra = {
        "kvoffload.disk_dir": str(tmp_path / "l3"),
        "kvoffload.disk_bytes": 64 * page_bytes,
        **OPTIMISER,
        "kvoffload.disk_write_budget": "1dwpd",
    }
    backend = backends(extra, pool, model="budget")
    (path,) = backend.paths
    assert isinstance(path.layer, OptimisingAdmission)
    credit = path.layer.write_credit
    assert credit is not None and credit.budget.block_bytes == page_bytes
    assert credit.budget.bytes_per_second() == pytest.approx(64 * page_bytes / 86_400)


def test_drive_writes_past_a_float_s_bytes_a_day_are_refused_naming_the_key(
    backends: Any, tmp_path: Path
) -> None:
    """``1e305dwpd`` of the disk tier's pages came to inf pages a second: the tier wrote as
    if no budget had been given, unsaid."""
    pytest.importorskip("sglang", reason="SGLang is not installed (CI installs it --no-deps)")
    from sglang_helpers import HostPool

    pool = HostPool()
    extra = {
        "kvoffload.disk_dir": str(tmp_path / "l3"),
        "kvoffload.disk_bytes": 64 * len(pool.page_bytes(0)),
        **OPTIMISER,
        "kvoffload.disk_write_budget": "1e305dwpd",
    }
    with pytest.raises(InvalidArgumentError) as error:
        backends(extra, pool, model="budget-overflow")
    assert str(error.value).startswith(
        "hicache-storage-backend-extra-config 'kvoffload.disk_write_budget': a write budget of "
        "1e+305 drive writes per day comes to more bytes a day than a float holds"
    )


@pytest.mark.parametrize(("mla", "shards"), [(False, 2), (True, 1)], ids=["mha", "mla"])
def test_the_shared_tier_is_sized_in_whole_pages_of_every_rank(
    backends: Any, valkey_server: Any, mla: bool, shards: int
) -> None:
    """``kvoffload.remote_bytes`` is the server's room for the whole instance: with TP=2 an
    MHA page is both ranks' halves there, so each rank's admission counts whole pages and
    the two ranks together keep a bytes budget (an MLA page is its one writer's, the only
    rank with an admission layer)."""
    pytest.importorskip("sglang", reason="SGLang is not installed (CI installs it --no-deps)")
    from sglang_helpers import HostPool

    page_bytes = len(HostPool(mla=mla).page_bytes(0))
    whole_page = shards * page_bytes
    extra = {
        "kvoffload.remote_url": valkey_server.url,
        "kvoffload.remote_admission": "recommended",
        "kvoffload.remote_bytes": 64 * whole_page,
        "kvoffload.remote_write_budget": f"{10 * whole_page}B/s",
    }
    for rank in range(2):
        pool = HostPool(mla=mla)
        backend = backends(extra, pool, tp_rank=rank, tp_size=2, mla=mla, model="whole-pages")
        (path,) = backend.paths
        if not backend.is_writer:  # an MLA model's other rank writes nothing
            assert path.layer is None
            continue
        assert isinstance(path.layer, OptimisingAdmission)
        assert path.layer.capacity == 64
        credit = path.layer.write_credit
        assert credit is not None
        assert credit.budget.blocks_per_second() == pytest.approx(10)


@pytest.mark.parametrize("budget", ["bytes", "dwpd"])
def test_the_ranks_disk_tiers_keep_one_budget_together(
    backends: Any, tmp_path: Path, budget: str
) -> None:
    """Each TP rank has its own slot file of ``kvoffload.disk_bytes``, all on the drive under
    ``kvoffload.disk_dir``: with TP=2 an MHA page is both ranks' halves, so each rank's
    optimiser counts whole pages and the two ranks together keep a bytes-per-second
    budget (each kept the whole of it: twice the bytes per second on the drive). Drive
    writes per day count against both ranks' files: the same pages per second per rank."""
    pytest.importorskip("sglang", reason="SGLang is not installed (CI installs it --no-deps)")
    from sglang_helpers import HostPool

    page_bytes = len(HostPool().page_bytes(0))
    whole_page = 2 * page_bytes
    disk_bytes = footprint(64, page_bytes)
    written = f"{10 * whole_page}B/s" if budget == "bytes" else "1dwpd"
    extra = {
        "kvoffload.disk_dir": str(tmp_path / "l3"),
        "kvoffload.disk_bytes": disk_bytes,
        **OPTIMISER,
        "kvoffload.disk_write_budget": written,
    }
    for rank in range(2):
        pool = HostPool()
        backend = backends(extra, pool, tp_rank=rank, tp_size=2, model="disk-whole-pages")
        (path,) = backend.paths
        assert isinstance(path.layer, OptimisingAdmission)
        credit = path.layer.write_credit
        assert credit is not None and credit.budget.block_bytes == whole_page
        pages_per_second = 10 if budget == "bytes" else disk_bytes / page_bytes / 86_400
        assert credit.budget.blocks_per_second() == pytest.approx(pages_per_second)
