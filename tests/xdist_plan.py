"""How the suite runs under pytest-xdist (``-n auto``, as the README's test command says).

``--dist loadscope`` (pyproject's addopts) hands out a module or class per unit, so module- and
class-wide fixtures are computed once. It hands out the units with the most tests first, which
puts the hypothesis state machines (one ``runTest`` each, and up to 40 s) last: the run then
ended with one worker in a machine and the other idle (for 36 s of 741 in a ``.ci/run`` on the
2-core dev VM). They go first instead. The engine tests are one unit, kept for
:data:`ENGINE_WORKER`'s last: their engines take minutes that mostly leave the CPU idle, so
that worker begins them when collection ends, in threads, and runs other tests meanwhile
(``tests/engine/conftest.py``); the other workers stop once only the engine tests are left.
(xdist's ``loadgroup`` would need the group in the node id, which pytest 9.2 no longer lets a
plugin rename.)
"""

from __future__ import annotations

from typing import Any

from kvoffload.core.cpus import usable_cpus

MAX_WORKERS = 4
"""Workers ``-n auto`` starts at most: each imports torch and starts its own Valkey servers,
and the engine tests take minutes whatever the number."""
ENGINE_TESTS = "tests/engine/"
"""Node ids of the engine tests start with this."""
ENGINE_FIGURES = "engine"
"""The user property under which the engine tests leave their measured figures; the root
conftest prints them at the end of the run (a worker's own output reaches no terminal)."""
ENGINE_WORKER = "gw0"
"""The worker that begins the engines when collection ends and runs the engine tests."""
STATE_MACHINE_TEST = "::runTest"
"""How a hypothesis state machine's one test ends its node id."""


def auto_workers() -> int:
    return min(MAX_WORKERS, usable_cpus())


def engine_tests_last(config: Any, log: Any) -> Any:
    """xdist's ``loadscope`` scheduler, with the state machines handed out first and the engine
    tests kept for :data:`ENGINE_WORKER`."""
    from xdist.scheduler import LoadScopeScheduling

    class EngineTestsLast(LoadScopeScheduling):
        state_machines_moved = False

        def _split_scope(self, nodeid: str) -> str:
            return ENGINE_TESTS if nodeid.startswith(ENGINE_TESTS) else super()._split_scope(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if not self.state_machines_moved:
                self.state_machines_moved = True
                machines = [
                    scope
                    for scope, unit in self.workqueue.items()
                    if all(nodeid.endswith(STATE_MACHINE_TEST) for nodeid in unit)
                ]
                for scope in reversed(machines):
                    self.workqueue.move_to_end(scope, last=False)
            if ENGINE_TESTS in self.workqueue:
                self.workqueue.move_to_end(ENGINE_TESTS)
                if len(self.workqueue) == 1 and node.workerinput["workerid"] != ENGINE_WORKER:
                    node.shutdown()  # after the tests it holds
                    return
            super()._assign_work_unit(node)

    return EngineTestsLast(config, log)
