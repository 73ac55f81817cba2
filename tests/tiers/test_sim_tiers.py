"""Simulated runs through CPU + disk + the shared tier: reports, CLI, and bytes verified."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pytest

from kvoffload import block_id_key
from kvoffload.cli.main import main
from kvoffload.cli.tier_options import separate_disk_dirs
from kvoffload.sim.run import SimConfig, simulate
from kvoffload.sim.workload import Request, Workload
from tier_servers import ValkeyProcess

TIER_FIELDS = {"hit_blocks", "stored_blocks", "read_bytes", "written_bytes", "failed"}


def promoted_workload() -> Workload:
    """Block run A falls out of a 16-block GPU and a 32-block CPU tier, comes back, and is reused.

    A; fillers of 42 blocks (A leaves both, reaching the lower tiers); A
    again (a lower-tier hit: its lookup starts the promotion and parks the
    request once; the retry loads A from the CPU tier); fillers of 20 blocks
    (A leaves the GPU only); A a third time: a plain CPU hit. Both loads of A
    come from promoted bytes, verified by the data plane.
    """
    a = list(range(4))
    fillers = [list(range(100 + 14 * i, 114 + 14 * i)) for i in range(3)]
    shorter = [list(range(200 + 10 * i, 210 + 10 * i)) for i in range(2)]
    order = [a, *fillers, a, *shorter, a]
    return Workload(
        "promoted",
        16,
        [
            Request(float(i), len(ids) * 16, 1, [block_id_key(b) for b in ids])
            for i, ids in enumerate(order)
        ],
    )


def config(**tiers: object) -> SimConfig:
    return SimConfig(gpu_blocks=16, cpu_blocks=32, layout="tiny", bound=False, **tiers)  # type: ignore[arg-type]


def test_a_disk_run_reports_every_tier_and_its_model(tmp_path: Path) -> None:
    report = simulate(promoted_workload(), config(disk_dir=str(tmp_path), disk_blocks=100))
    tiers = report.tiers
    assert set(tiers) == {"cpu", "disk"} and set(tiers["disk"]) >= TIER_FIELDS
    assert tiers["disk"]["hit_blocks"] == 4  # A, promoted once
    assert report.lookups_deferred == 1  # the second A waited for it once
    assert tiers["cpu"]["hit_blocks"] == 8 == report.offload_hit_blocks  # A loaded twice
    disk_stored = tiers["disk"]["stored_blocks"]
    assert isinstance(disk_stored, int) and disk_stored >= 4
    assert tiers["disk"]["written_bytes"] == disk_stored * report.bytes_per_block
    read_seconds = tiers["disk"]["read_seconds"]
    assert isinstance(read_seconds, float) and read_seconds > 0
    assert json.loads(json.dumps(report.as_dict()))["tiers"]["disk"]["hit_blocks"] == 4


def test_offload_evictions_are_the_cpu_tiers_promotions_included(tmp_path: Path) -> None:
    """A promotion from the disk evicts a CPU block that no store of the engine reported:
    the report's evictions are the CPU tier's own count."""
    report = simulate(promoted_workload(), config(disk_dir=str(tmp_path), disk_blocks=100))
    evicted = report.tiers["cpu"]["evicted"]
    assert report.offload_evictions == evicted
    assert isinstance(evicted, int) and evicted > 0


def test_the_disk_tier_has_its_own_policy(tmp_path: Path) -> None:
    from kvoffload.tiers import DiskTier, build_stack

    for disk_policy, expected in ((None, "LRUCachePolicy"), ("arc", "ARCCachePolicy")):
        cfg = config(disk_dir=str(tmp_path), disk_blocks=100, disk_policy=disk_policy)
        stack = build_stack(cfg.stack_config(bytes(16)))
        try:
            disk = stack.disk
            assert isinstance(disk, DiskTier) and type(disk.policy).__name__ == expected
        finally:
            stack.close()


def test_without_lower_tiers_the_report_has_the_cpu_tier_only() -> None:
    report = simulate(promoted_workload(), config())
    assert set(report.tiers) == {"cpu"}
    assert report.tiers["cpu"]["hit_blocks"] == report.offload_hit_blocks


def test_bytes_come_back_bit_exact_through_disk_and_remote(
    tmp_path: Path, own_server: ValkeyProcess
) -> None:
    pytest.importorskip("torch")
    from kvoffload.core.layout import layout_preset
    from kvoffload.sim.dataplane_backend import DataPlaneBackend

    own_server.start()
    for tiers in (
        {"disk_dir": str(tmp_path / "disk"), "disk_blocks": 100},
        {"remote_url": own_server.url},
    ):
        backend = DataPlaneBackend(layout_preset("tiny").with_block_size(16), 16, 32)
        report = simulate(promoted_workload(), config(**tiers), backend)
        lower = "disk" if "disk_dir" in tiers else "remote"
        assert report.tiers[lower]["hit_blocks"] == 4
        assert backend.verified_blocks == 8 and backend.mismatched_blocks == 0
        assert backend.failed_jobs == 0


def test_simulate_twice_against_one_server_hits_what_the_first_run_stored(
    tmp_path: Path, own_server: ValkeyProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    own_server.start()
    runs = []
    for i in range(2):
        path = tmp_path / f"run{i}.json"
        argv = ["simulate", "--mix", "oneshot=1", "--requests", "30", "--gpu-blocks", "1500"]
        argv += ["--cpu-blocks", "300", "--layout", "tiny", "--no-bound", "--no-progress"]
        argv += ["--remote", own_server.url, "--json", str(path)]
        assert main(argv) == 0
        runs.append(json.loads(path.read_text()))
    assert "remote" in capsys.readouterr().out
    first, second = runs
    stored = first["tiers"]["remote"]["stored_blocks"]
    assert first["tiers"]["remote"]["hit_blocks"] == 0 and stored == first["refs"] > 0
    # One-shot prompts: within a run nothing is reused, so every offload hit of the second
    # run is a block the first stored, promoted from the server once and loaded once.
    remote = second["tiers"]["remote"]
    assert 0 < remote["hit_blocks"] == second["offload_hit_blocks"] <= stored
    # Not all of them: the requests parked while their promotions run reserve the 300-block
    # CPU tier, and a request that then finds no room promotes nothing and computes its
    # blocks. Each request is parked at most once (its retry finds its promotion landed).
    assert second["offload_hit_blocks"] + second["computed_blocks"] == second["refs"] == stored
    assert second["lookups_deferred"] <= second["requests"]
    # Write-through sends the blocks it computed and stored to the server again; promoted
    # blocks are never written back to where they came from.
    assert remote["stored_blocks"] == second["offload_blocks_written"]
    assert second["stores_skipped_by_admission"] == 0


def test_csv_flattens_the_tiers_and_sweep_gives_each_run_its_own_disk(tmp_path: Path) -> None:
    path = tmp_path / "run.csv"
    argv = ["simulate", "--requests", "20", "--gpu-blocks", "1500", "--cpu-blocks", "100"]
    argv += ["--layout", "tiny", "--no-bound", "--no-progress", "--disk-dir", str(tmp_path / "d")]
    assert main([*argv, "--disk-blocks", "500", "--csv", str(path)]) == 0
    [row] = list(csv.DictReader(path.read_text().splitlines()))
    assert int(row["tiers.disk.stored_blocks"]) > 0 and "tiers.cpu.hit_blocks" in row
    sweep = ["sweep", "--requests", "20", "--gpu-blocks", "1500", "--cpu-blocks", "50,100"]
    sweep += ["--policies", "lru", "--thresholds", "0", "--layout", "tiny", "--jobs", "1"]
    sweep += ["--disk-dir", str(tmp_path / "s"), "--disk-gb", "1", "--json", str(path)]
    assert main([*sweep, "--no-progress"]) == 0
    rows = json.loads(path.read_text())
    assert [r["tiers"]["disk"]["stored_blocks"] > 0 for r in rows] == [True, True]
    names = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert names == ["cpu100-lru-t0-none", "cpu50-lru-t0-none"]


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_sweep_runs_differing_only_in_admission_never_share_a_disk(
    tmp_path: Path, jobs: str
) -> None:
    """They once shared one subdirectory: the second run read the first's blocks, and in
    parallel the second failed "in use by process". An alias and its rule run once."""
    path = tmp_path / "sweep.json"
    sweep = ["sweep", "--requests", "40", "--gpu-blocks", "1500", "--cpu-blocks", "300"]
    sweep += ["--policies", "lru", "--thresholds", "0", "--layout", "tiny", "--jobs", jobs]
    sweep += ["--admissions", "none,feedback,recommended,optimiser", "--no-progress"]
    sweep += ["--disk-dir", str(tmp_path / "s"), "--disk-blocks", "300", "--json", str(path)]
    assert main(sweep) == 0
    rows = json.loads(path.read_text())
    assert [r["tiers"]["disk"]["recovered"] for r in rows] == [0, 0, 0]
    names = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert names == [f"cpu300-lru-t0-{a}" for a in ("feedback", "none", "optimiser")]


def test_two_runs_of_the_same_settings_get_disks_of_their_own(tmp_path: Path) -> None:
    """A sweep runs each setting once, but should two configurations ever agree, the
    second's disk is numbered rather than shared."""
    config = SimConfig(gpu_blocks=1500, cpu_blocks=300, disk_dir=str(tmp_path), disk_blocks=300)
    again = dataclasses.replace(config, admission="recommended")
    dirs = [c.disk_dir for c in separate_disk_dirs([config, again, config])]
    names = [Path(d).name for d in dirs if d is not None]
    assert names == ["cpu300-lru-t0-none", "cpu300-lru-t0-optimiser", "cpu300-lru-t0-none-2"]


def test_a_sweep_of_several_runs_against_one_server_is_refused(
    tmp_path: Path, own_server: ValkeyProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every run would hit what the others stored on the shared server; one run is fine."""
    own_server.start()
    sweep = ["sweep", "--requests", "20", "--gpu-blocks", "1500", "--policies", "lru"]
    sweep += ["--thresholds", "0", "--layout", "tiny", "--jobs", "1", "--no-progress"]
    sweep += ["--remote", own_server.url]
    assert main([*sweep, "--cpu-blocks", "100,200"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvoffload: error: --remote: the 2 runs of this sweep would share")
    assert err.count("\n") == 1
    assert main([*sweep, "--cpu-blocks", "100"]) == 0


def test_tier_options_fail_with_one_clear_line(
    tmp_path: Path, own_server: ValkeyProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["simulate", "--requests", "5", "--no-bound", "--no-progress"]
    assert main([*base, "--disk-dir", str(tmp_path)]) != 0
    assert "needs a size" in capsys.readouterr().err
    assert main([*base, "--disk-dir", str(tmp_path), "--disk-gb", "1", "--disk-policy", "x"]) != 0
    assert "--disk-policy: unknown cache policy 'x'" in capsys.readouterr().err
    assert main([*base, "--remote", "http://nowhere"]) != 0
    assert "must start with" in capsys.readouterr().err
    assert main([*base, "--remote", f"redis://127.0.0.1:{own_server.port}/0?timeout_ms=50"]) != 0
    err = capsys.readouterr().err
    assert "not reachable" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_lower_tiers_have_no_belady_bound(tmp_path: Path) -> None:
    # Their hits can come from blocks stored before the run (a reused disk directory, a
    # shared server), which no bound over this run's requests knows of.
    bounded = dataclasses.replace(config(disk_dir=str(tmp_path), disk_blocks=100), bound=True)
    report = simulate(promoted_workload(), bounded)
    assert report.belady_total_hit_ratio is None and report.belady_offload_hit_ratio is None
    cpu_only = dataclasses.replace(config(), bound=True)
    assert simulate(promoted_workload(), cpu_only).belady_total_hit_ratio is not None
