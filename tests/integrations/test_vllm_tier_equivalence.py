"""With a disk tier below the CPU tier, vLLM's per-key API through our adapter decides as the
simulator does, block for block.

Both replay the same seeded workloads: ``kvoffload.sim.run.simulate`` with a disk tier (the
stack ``kvoffload simulate --disk-dir`` runs), and ``kvoffload.integrations.vllm.replay``
through ``VLLMManagerAdapter`` over the same stack configuration, a request whose scan a
promotion deferred asked again in the next step, as vLLM's scheduler does. The shape is the
filler one of ``test_vllm_sim_equivalence.py`` (a request of GPU-cache size after each
request turns the GPU cache over), so every reference reaches the tiers and neither of the
GPU-hit differences documented there applies; arrivals lie far apart, so the simulator never
runs another request while one waits for its promotion (it would, as vLLM does, and the
orders would differ). The CPU tier holds twice the longest request.

One difference of semantics remains, vLLM's again: the simulator touches every key of a
request before looking it up (the seed's ``touch``), vLLM 0.33 makes a key recent only when
the request loads or stores it. A promotion evicts at lookup time, so under vLLM it may evict
the request's own CPU-held blocks past the promoted run, write them to disk and read them back
in the next step. ``test_a_promotion_evicting_its_own_requests_blocks_is_the_whole_difference``
shows that, where it shows, this touch is the whole difference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvoffload import block_id_key
from kvoffload.core.keys import OffloadKey
from kvoffload.managers.stack import Stack, StackConfig
from kvoffload.sim.generators import generate
from kvoffload.sim.run import RunReport, SimConfig, simulate, whatif_table
from kvoffload.sim.workload import Request, Workload

WORKLOADS = {
    "chat": ({"chat": 1.0}, 200, 16),
    "one-shot heavy": ({"oneshot": 0.8, "rag": 0.2}, 300, 256),
    "longchat": ({"longchat": 1.0}, 200, 512),
}
APART_S = 1000.0
"""Between two arrivals: longer than any request of these workloads takes in the simulator."""


@pytest.fixture
def recency_at_access(vllm_modules: dict[str, ModuleType]) -> None:
    """Skips a comparison with the simulator under a vLLM whose recency rule is another."""
    from kvoffload.integrations.vllm.versions import running_release

    if not running_release().recency_at_access:
        pytest.skip(
            "this vLLM makes a request's blocks recent when it finishes (0.32), the "
            "simulator when they are used: the same rules over another LRU order"
        )


def _with_fillers(requests: list[Request], gpu: int, block_tokens: int) -> list[Request]:
    """Each request followed by one of ``gpu`` blocks never seen again, each arriving after
    the one before has finished."""
    out: list[Request] = []
    for i, request in enumerate(requests):
        out.append(
            Request(2 * i * APART_S, request.input_tokens, request.output_tokens, request.keys)
        )
        filler = [block_id_key(10**9 + i * gpu + j) for j in range(gpu)]
        out.append(Request((2 * i + 1) * APART_S, gpu * block_tokens, 1, filler))
    return out


def _trace(name: str) -> tuple[list[Request], int, int]:
    """The filler trace of workload ``name``, its GPU cache and block size."""
    mix, requests, block_tokens = WORKLOADS[name]
    workload = generate(mix, num_requests=requests, seed=0, block_tokens=block_tokens, rate=1.0)
    longest = max(len(r.keys) for r in workload.requests)
    return _with_fillers(workload.requests, longest, block_tokens), longest, block_tokens


Adapter = Callable[[SimConfig, int], tuple[Any, Stack]]


@pytest.fixture
def adapter(vllm_modules: dict[str, ModuleType]) -> Iterator[Adapter]:
    """Builds our vLLM adapter over the stack a ``SimConfig`` describes; closes its tiers."""
    from kvoffload.integrations.vllm.adapter import VLLMManagerAdapter
    from kvoffload.tiers import build_stack, fingerprint_of

    stacks: list[Stack] = []

    def make(config: SimConfig, block_tokens: int) -> tuple[Any, Stack]:
        bytes_per_block = config.engine_config(block_tokens).bytes_per_block
        stack_config = config.stack_config(fingerprint_of("rpl21"), bytes_per_block=bytes_per_block)
        assert isinstance(stack_config, StackConfig) and stack_config.wait_for_tiers

        def build() -> Stack:
            stacks.append(build_stack(stack_config))
            return stacks[-1]

        made = VLLMManagerAdapter(build)
        return made, stacks[-1]

    yield make
    for stack in stacks:
        stack.close()


def _simulated(trace: list[Request], block_tokens: int, config: SimConfig) -> RunReport:
    return simulate(Workload("equivalence", block_tokens, trace), config)


def _disk_figures(stack: Stack) -> dict[str, Any]:
    """The disk tier's figures as the simulator's report names them, once its I/O is done."""
    tiered = stack.tiered
    assert tiered is not None
    tiered.close()
    (disk,) = tiered.tiers
    figures: dict[str, Any] = {
        "hit_blocks": disk.stats.hit_blocks,
        "stored_blocks": disk.stats.stored_blocks,
        "evicted": disk.stats.evicted,
        "offered_blocks": tiered.offered_blocks[0],
        "admitted_blocks": tiered.admitted_blocks[0],
    }
    layer = stack.disk_admission
    if layer is not None:
        stats = layer.stats()
        figures["admission_candidate"] = stats.candidate
        figures["admission_switches"] = stats.switches
        figures["whatif"] = whatif_table(stats.whatif_total)
    return figures


@pytest.mark.parametrize("disk_admission", ["none", "recommended"])
@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.usefixtures("recency_at_access")
def test_the_tiers_decide_the_same_under_vllms_adapter(
    tmp_path: Path, adapter: Adapter, name: str, disk_admission: str
) -> None:
    from kvoffload.integrations.vllm.replay import replay

    trace, gpu, block_tokens = _trace(name)

    def config(where: str) -> SimConfig:
        return SimConfig(
            gpu,
            2 * gpu,
            disk_dir=str(tmp_path / where),
            disk_blocks=4 * gpu,
            disk_admission=disk_admission,
            bound=False,
        )

    report = _simulated(trace, block_tokens, config("simulated"))
    manager, stack = adapter(config("vllm"), block_tokens)
    result = replay(manager, trace, block_tokens, gpu_blocks=gpu)
    theirs = _disk_figures(stack)

    assert (result.refs, result.gpu_hit_blocks, report.gpu_hit_blocks) == (report.refs, 0, 0)
    assert result.hit_blocks == report.offload_hit_blocks > 0  # CPU hits, promotions included
    assert result.written_blocks == report.offload_blocks_written > 0
    assert result.delayed_scans == report.lookups_deferred > 0  # one retry per promotion
    ours = {key: report.tiers["disk"][key] for key in theirs}
    assert theirs == ours
    assert ours["hit_blocks"] > 0 and ours["admitted_blocks"] > 0
    if disk_admission == "recommended":
        assert len([f for table in ours["whatif"].values() for f in table]) == 12


class _TouchingFirst:
    """Our adapter, with the simulator's touch of a request's keys before its lookup."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def on_new_request(self, req_context: Any) -> Any:
        answer = self._manager.on_new_request(req_context)
        recorded: dict[OffloadKey, int] = req_context._offload_key_positions
        self._manager.backing.touch(sorted(recorded, key=recorded.__getitem__))
        return answer


@pytest.mark.usefixtures("recency_at_access")
def test_a_promotion_evicting_its_own_requests_blocks_is_the_whole_difference(
    tmp_path: Path, adapter: Adapter
) -> None:
    """A CPU tier of 100 blocks under 199-block chat requests: a promotion evicts blocks its
    own request holds past the promoted run (the simulator touched them first), writes them
    back and reads them again: 10 more blocks read from disk and written back, the same hits.
    With the simulator's touch before each lookup the replays agree again."""
    from kvoffload.integrations.vllm.replay import replay

    trace, gpu, block_tokens = _trace("chat")

    def config(where: str) -> SimConfig:
        return SimConfig(gpu, 100, disk_dir=str(tmp_path / where), disk_blocks=400, bound=False)

    report = _simulated(trace, block_tokens, config("simulated"))
    simulated = {key: report.tiers["disk"][key] for key in ("hit_blocks", "offered_blocks")}
    plain, plain_stack = adapter(config("vllm"), block_tokens)
    touching, touching_stack = adapter(config("vllm-touching"), block_tokens)
    as_vllm = replay(plain, trace, block_tokens, gpu_blocks=gpu)
    with_touch = replay(_TouchingFirst(touching), trace, block_tokens, gpu_blocks=gpu)

    assert as_vllm.hit_blocks == with_touch.hit_blocks == report.offload_hit_blocks
    assert with_touch.delayed_scans == report.lookups_deferred < as_vllm.delayed_scans
    assert {key: _disk_figures(touching_stack)[key] for key in simulated} == simulated
    reread = {key: _disk_figures(plain_stack)[key] - simulated[key] for key in simulated}
    assert reread == {"hit_blocks": 10, "offered_blocks": 10}


def test_a_run_only_the_disk_holds_is_waited_for_and_counted_once(
    tmp_path: Path, adapter: Adapter
) -> None:
    """The replay's scan that a promotion defers (``RETRY``) is asked again in the next
    step: the run is loaded, not taken for a miss, and the request is counted once."""
    from kvoffload.integrations.vllm.replay import replay

    first = [block_id_key(i) for i in range(8)]
    others = [block_id_key(100 + i) for i in range(8)]
    trace = [Request(float(i), 8 * 16, 1, keys) for i, keys in enumerate([first, others, first])]
    config = SimConfig(8, 8, disk_dir=str(tmp_path / "disk"), disk_blocks=32, bound=False)
    manager, stack = adapter(config, 16)

    result = replay(manager, trace, 16)

    assert (result.refs, result.hit_blocks, result.delayed_scans) == (24, 8, 1)
    assert result.written_blocks == 16
    assert stack.tiered is not None and stack.tiered.promotion_batches == [1]
    assert manager.counters.loads == 8
