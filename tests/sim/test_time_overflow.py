"""A replay whose simulated clock would pass what a float holds is refused, naming the wait
it was at and the setting that times that wait (the command line refuses it before the run,
naming its options; this is the library's own refusal)."""

from __future__ import annotations

import pytest

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.sim.generators import generate
from kvoffload.sim.run import SimConfig, simulate


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"prefill_tokens_per_s": 1e-308}, "at a prefill timed by prefill_tokens_per_s 1e-308"),
        ({"decode_tokens_per_s": 1e-308}, "at a decode timed by decode_tokens_per_s 1e-308"),
        ({"transfer_gb_per_s": 1e-308}, "at a store timed by transfer_bytes_per_s 1e-299"),
    ],
)
def test_a_wait_past_a_float_names_its_setting(setting: dict[str, float], named: str) -> None:
    """All three said "a prefill, decode or transfer throughput is too low"."""
    config = SimConfig(gpu_blocks=5000, cpu_blocks=5000, bound=False, **setting)
    with pytest.raises(InvalidArgumentError, match=named):
        simulate(generate(num_requests=20), config)
