"""The suite's xdist scheduler (``tests/xdist_plan.py``), driven as xdist's controller drives
it, with stand-in workers: the engine tests go, as one unit, to the worker that began their
engines, once every other unit is handed out; the other workers are told to stop then."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from tier_servers import worker_port_range
from xdist_plan import ENGINE_TESTS, ENGINE_WORKER, engine_tests_last

pytest.importorskip("xdist")

MACHINE = "TestStackMachine"
COLLECTION = [
    *(f"tests/core/test_a.py::test_{i}" for i in range(6)),
    *(f"{ENGINE_TESTS}test_engine.py::test_{i}" for i in range(3)),
    *(f"tests/sim/test_b.py::TestB::test_{i}[{i}]" for i in range(4)),
    *(f"tests/sim/test_b.py::test_{i}" for i in range(2)),
    f"{ENGINE_TESTS}test_serve.py::test_serve",
    *(f"tests/tiers/test_c.py::test_{i}" for i in range(5)),
    f"tests/tiers/test_d.py::{MACHINE}::runTest",
]
"""Engine tests of two modules among others: the module of 6 is the largest unit, which
plain ``loadscope`` hands out first, and the engine tests are not; a state machine last."""


class StandInWorker:
    """What the scheduler asks of a worker: its id, the tests it is sent, to stop."""

    def __init__(self, workerid: str, sends: list[tuple[str, list[int]]]) -> None:
        self.workerinput = {"workerid": workerid}
        self.gateway = SimpleNamespace(id=workerid)
        self.sent: list[int] = []
        self.shutting_down = False
        self._sends = sends

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices
        self._sends.append((self.workerinput["workerid"], list(indices)))

    def shutdown(self) -> None:
        self.shutting_down = True


@pytest.mark.parametrize("workers", [["gw1", ENGINE_WORKER], [ENGINE_WORKER, "gw1", "gw2"]])
def test_the_engine_tests_go_last_to_the_worker_that_began_the_engines(
    pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch, workers: list[str]
) -> None:
    monkeypatch.setattr(pytestconfig.option, "tx", ["popen"] * len(workers), raising=False)
    scheduler = engine_tests_last(pytestconfig, None)
    sends: list[tuple[str, list[int]]] = []
    stand_ins = [StandInWorker(workerid, sends) for workerid in workers]
    for worker in stand_ins:
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, COLLECTION)
    scheduler.schedule()
    ran = dict.fromkeys(stand_ins, 0)
    while any(ran[worker] < len(worker.sent) for worker in stand_ins):
        for worker in stand_ins:  # each worker runs one of its tests a turn
            if ran[worker] < len(worker.sent):
                scheduler.mark_test_complete(worker, worker.sent[ran[worker]])
                ran[worker] += 1
    engine = sorted(i for i, nodeid in enumerate(COLLECTION) if nodeid.startswith(ENGINE_TESTS))
    assert sends[-1] == (ENGINE_WORKER, engine), sends
    machine = [i for i, nodeid in enumerate(COLLECTION) if MACHINE in nodeid]
    assert sends[0] == (workers[0], machine), sends  # the longest unit, first
    assert sorted(i for worker in stand_ins for i in worker.sent) == list(range(len(COLLECTION)))
    assert all(worker.shutting_down for worker in stand_ins)


@pytest.mark.parametrize("count", [2, 3, 4])
def test_each_worker_draws_its_server_ports_from_a_slice_of_its_own(
    monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    """A port one worker checked free, or freed to restart its server on, is no other's."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(count))
    slices = []
    for index in range(count):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
        slices.append(worker_port_range(11_000, 22_767))
    assert slices == sorted(slices) and slices[0][0] >= 11_000 and slices[-1][1] <= 22_767
    assert all(high < next_low for (_, high), (next_low, _) in itertools.pairwise(slices))
    assert all(high - low >= 1_000 for low, high in slices)
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert worker_port_range(11_000, 22_767) == (11_000, 22_767)
