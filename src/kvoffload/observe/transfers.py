"""Transfer latency, taken from the data plane's own job results.

The simulator's data-plane backend reports each finished job with the
seconds its copy took; this proxy sits between the backend and its worker
and records them per direction, so latency means copy time, not the time
the replay took to get round to the job.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from kvoffload.observe.counters import LatencyHistogram

DIRECTIONS = {("GPU", "CPU"): "store", ("CPU", "GPU"): "load"}
"""``(source, destination)`` media to the direction's label."""


class ObservedWorker:
    """Forwards every call to ``worker``; records each finished job's ``transfer_time``."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker
        self.latency = {direction: LatencyHistogram() for direction in DIRECTIONS.values()}

    def transfer_async(self, job_id: int, spec: Any) -> bool:
        return bool(self._worker.transfer_async(job_id, spec))

    def get_finished(self) -> list[Any]:
        results: list[Any] = self._worker.get_finished()
        for result in results:
            direction = DIRECTIONS.get(result.transfer_type)
            if direction is not None and result.success and result.transfer_time is not None:
                self.latency[direction].observe(result.transfer_time)
        return results

    def wait(self, job_ids: Collection[int]) -> None:
        self._worker.wait(job_ids)

    def close(self) -> None:
        self._worker.close()
