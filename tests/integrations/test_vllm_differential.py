"""Our spec's manager against vLLM's own CPUOffloadingManager, call by call: a hypothesis
state machine makes the same per-key calls on both (lookups, loads, stores that land or
fail, requests that finish, cache resets) and compares every answer, slot and event.

LRU runs requests one after another: with requests interleaved, vLLM 0.33's LRU ranks a
request's blocks by when the request began, ours by when they were used (docs/vllm.md).
ARC runs them interleaved as well.
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from vllm_helpers import create_spec, request_context

from kvoffload import block_id_key

KEYS = [block_id_key(i) for i in range(10)]


def _events(manager: Any) -> list[tuple[list[bytes], bool, bool]]:
    return [
        (list(event.keys), event.removed, getattr(event, "metadata_only", False))
        for event in manager.take_events()
    ]


def _store(output: Any) -> Any:
    if output is None:
        return None
    return output.keys_to_store, output.store_spec.block_ids.tolist(), output.evicted_keys


class _Request:
    def __init__(self, name: str, keys: list[bytes]) -> None:
        self.keys = keys
        self.ours = request_context(name, keys)
        self.theirs = request_context(name, keys)
        self.loads: list[list[bytes]] = []
        self.stores: list[list[bytes]] = []


class SameAsVLLM(RuleBasedStateMachine):
    """Both managers driven alike; any difference in what they answer or publish fails."""

    def __init__(self) -> None:
        super().__init__()
        self.live: list[_Request] = []
        self.count = 0

    @initialize(
        policy=st.sampled_from(["lru", "arc"]),
        capacity=st.integers(1, 6),
        threshold=st.sampled_from([0, 2]),
        interleaved=st.booleans(),
    )
    def build(self, policy: str, capacity: int, threshold: int, interleaved: bool) -> None:
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        extra = {"cpu_bytes_to_use": capacity * 1024, "eviction_policy": policy}
        extra["store_threshold"] = threshold
        self.ours = create_spec(extra, events=True).get_manager()
        self.theirs = CPUOffloadingManager(
            capacity, policy, enable_events=True, store_threshold=threshold
        )
        self.interleaved = interleaved and policy == "arc"

    def _finish(self, request: _Request) -> None:
        for keys in request.loads:
            self.ours.complete_load(keys, request.ours)
            self.theirs.complete_load(keys, request.theirs)
        request.loads.clear()
        self.ours.on_request_finished(request.ours)
        self.theirs.on_request_finished(request.theirs)
        self.live.remove(request)

    @rule(ids=st.lists(st.integers(0, 9), min_size=1, max_size=5, unique=True))
    def new_request(self, ids: list[int]) -> None:
        if not self.interleaved:
            for request in list(self.live):
                self._finish(request)
        self.count += 1
        request = _Request(f"r{self.count}", [KEYS[i] for i in ids])
        self.ours.on_new_request(request.ours)
        self.theirs.on_new_request(request.theirs)
        self.live.append(request)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def lookup_and_load(self, data: st.DataObject) -> None:
        from vllm.v1.kv_offload.base import LookupResult

        request = data.draw(st.sampled_from(self.live))
        hits = []
        for key in request.keys:
            answer = self.theirs.lookup(key, request.theirs)
            assert self.ours.lookup(key, request.ours) == answer
            if answer is not LookupResult.HIT:
                break
            hits.append(key)
        if hits and data.draw(st.booleans()):
            theirs = self.theirs.prepare_load(hits, request.theirs).block_ids.tolist()
            assert self.ours.prepare_load(hits, request.ours).block_ids.tolist() == theirs
            request.loads.append(hits)

    @precondition(lambda self: any(r.loads for r in self.live))
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from([r for r in self.live if r.loads]))
        keys = request.loads.pop(0)
        self.ours.complete_load(keys, request.ours)
        self.theirs.complete_load(keys, request.theirs)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def prepare_store(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.live))
        start = data.draw(st.integers(0, len(request.keys) - 1))
        offer = request.keys[start:]
        theirs = _store(self.theirs.prepare_store(offer, request.theirs))
        assert _store(self.ours.prepare_store(offer, request.ours)) == theirs
        if theirs is not None and theirs[0]:
            request.stores.append(list(theirs[0]))

    @precondition(lambda self: any(r.stores for r in self.live))
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        request = data.draw(st.sampled_from([r for r in self.live if r.stores]))
        keys = request.stores.pop(0)
        self.ours.complete_store(keys, request.ours, success)
        self.theirs.complete_store(keys, request.theirs, success)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self._finish(data.draw(st.sampled_from(self.live)))

    @precondition(lambda self: hasattr(self, "ours"))
    @rule()
    def reset(self) -> None:
        """Both drop every block; vLLM never completes a job from before a reset, and the
        events queued before it still go out."""
        self.ours.reset_cache()
        self.theirs.reset_cache()
        for request in self.live:
            request.loads.clear()
            request.stores.clear()

    @precondition(lambda self: hasattr(self, "ours"))
    @rule()
    def same_events(self) -> None:
        """Taken now and then, so that events queue up across other calls (a reset too)."""
        assert _events(self.ours) == _events(self.theirs)

    def teardown(self) -> None:
        if hasattr(self, "ours"):
            self.same_events()


SameAsVLLM.TestCase.settings = settings(max_examples=600, stateful_step_count=50, deadline=None)


def test_every_call_matches_vllms_manager(vllm_modules: Any) -> None:
    SameAsVLLM.TestCase().runTest()


def test_a_request_running_across_a_reset_starts_afresh_as_in_vllm(vllm_modules: Any) -> None:
    """vLLM's manager forgets what a request read before a reset (its blocks are gone, the
    request offers them again from the first): the block it stores again is an insertion,
    not a reuse, so ARC keeps it in T1 and evicts it first, as vLLM does."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    def victims(manager: Any) -> list[bytes]:
        def store(name: str, key: bytes) -> Any:
            context = request_context(name, [key])
            manager.on_new_request(context)
            output = manager.prepare_store([key], context)
            manager.complete_store(output.keys_to_store, context)
            return context

        manager.on_request_finished(store("writer", KEYS[0]))
        reader = request_context("reader", [KEYS[0]])
        manager.on_new_request(reader)
        manager.prepare_load([KEYS[0]], reader)
        manager.reset_cache()  # the reader runs on; its load is a pre-reset job
        manager.complete_store(manager.prepare_store([KEYS[0]], reader).keys_to_store, reader)
        manager.on_request_finished(reader)
        manager.on_request_finished(store("other", KEYS[1]))
        context = request_context("evicting", [KEYS[2]])
        manager.on_new_request(context)
        return list(manager.prepare_store([KEYS[2]], context).evicted_keys)

    extra = {"cpu_bytes_to_use": 2 * 1024, "eviction_policy": "arc"}
    theirs = victims(CPUOffloadingManager(2, "arc"))
    assert theirs == [KEYS[0]]
    assert victims(create_spec(extra).get_manager()) == theirs
