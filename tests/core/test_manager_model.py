"""Model-based tests: the manager (with and without the reuse filter) against a plain model.

Every registered policy runs the same machine, alone, behind the seed filter,
and with each admission layer stacked (under the filter when both are used).
An admission layer may offer the tier any subset of what reaches it, in order;
the model then follows what the tier was actually offered.

After every step: lookups agree with the model's longest ready prefix, slot
ids are unique and in range, the held blocks and their states match the
model, and replaying all events (and the removals of broken blocks, which the
caller announces) gives exactly the ready set. A ``None`` from
``prepare_store`` must leave every bit of state as it was; evictions may only
take ready, unpinned keys outside the offer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvoffload import (
    BlockStateError,
    CPUOffloadingManager,
    FilterReusedOffloadingManager,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    available_policies,
    block_id_key,
)
from kvoffload.admission import OptimisingAdmission, available_admissions, wrap_with_admission
from kvoffload.admission.optimiser import CANDIDATES
from kvoffload.admission.registry import ALIASES as ADMISSION_ALIASES
from kvoffload.policies.registry import _POLICIES, ALIASES

UNIVERSE = [block_id_key(i) for i in range(5)]
KEY_LISTS = st.lists(st.sampled_from(UNIVERSE), max_size=6)
PENDING = -1


class RecordingCPU(CPUOffloadingManager):
    """The real CPU manager, remembering what its last ``prepare_store`` was offered."""

    last_offer: list[OffloadKey]

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        self.last_offer = list(keys)
        return super().prepare_store(self.last_offer)


def is_subsequence(sub: list[OffloadKey], seq: list[OffloadKey]) -> bool:
    it = iter(seq)
    return all(any(key == other for other in it) for key in sub)


def snapshot(m: CPUOffloadingManager) -> object:
    status = {k: (b.block_id, b.ref_cnt) for k, b in m._blocks.items()}
    policy = {name: list(v) if hasattr(v, "keys") else v for name, v in vars(m.policy).items()}
    return status, policy, [b.block_id for b in m._free], m._num_allocated


class ManagerMachine(RuleBasedStateMachine):
    policy = "lru"
    use_filter = False
    admission = "none"

    @initialize(capacity=st.integers(1, 3), threshold=st.integers(2, 3), tracker=st.integers(1, 6))
    def setup(self, capacity: int, threshold: int, tracker: int) -> None:
        self.capacity = capacity
        self.cpu = RecordingCPU(capacity, self.policy, enable_events=True)
        self.manager: OffloadingManager = wrap_with_admission(self.admission, self.cpu, capacity)
        if self.use_filter:
            self.manager = FilterReusedOffloadingManager(self.manager, threshold, tracker)
        self.threshold, self.tracker = threshold, tracker
        self.ref: dict[OffloadKey, int] = {}  # model: key -> ref count (PENDING = -1)
        self.slot: dict[OffloadKey, int] = {}
        self.counts: list[list[Any]] = []  # model tracker: [key, count], least recent first
        self.replayed: set[OffloadKey] = set()

    def count_lookup(self, keys: list[OffloadKey]) -> None:
        for key in keys:
            entry = next((e for e in self.counts if e[0] == key), None)
            if entry is None:
                if len(self.counts) >= self.tracker:
                    self.counts.pop(0)
                self.counts.append([key, 1])
            else:
                self.counts.remove(entry)
                entry[1] += 1
                self.counts.append(entry)

    def eligible(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        if not self.use_filter:
            return keys
        seen = {key: count for key, count in self.counts}
        return [k for k in keys if seen.get(k, 0) >= self.threshold]

    @rule(keys=KEY_LISTS)
    def lookup(self, keys: list[OffloadKey]) -> None:
        expected = 0
        for key in keys:
            if self.ref.get(key, PENDING) < 0:
                break
            expected += 1
        if self.use_filter:
            self.count_lookup(keys)
        assert self.manager.lookup(iter(keys)) == expected

    @rule(keys=KEY_LISTS)
    def touch(self, keys: list[OffloadKey]) -> None:
        self.manager.touch(iter(keys))

    @rule(keys=KEY_LISTS)
    def prepare_store(self, keys: list[OffloadKey]) -> None:
        eligible = list(dict.fromkeys(self.eligible(keys)))
        before = snapshot(self.cpu)
        out = self.manager.prepare_store(iter(keys))
        offered = list(dict.fromkeys(self.cpu.last_offer))
        if self.admission == "none":
            assert offered == eligible
        else:
            assert is_subsequence(offered, eligible)
        to_store = [k for k in offered if k not in self.ref]
        evictable = {k for k, r in self.ref.items() if r == 0 and k not in offered}
        need = len(to_store) - (self.capacity - len(self.ref))
        if to_store and need > len(evictable):
            assert out is None
            assert snapshot(self.cpu) == before
            return
        assert out is not None
        assert out.keys_to_store == to_store
        assert len(out.evicted_keys) == max(need, 0)
        assert set(out.evicted_keys) <= evictable
        assert len(set(out.evicted_keys)) == len(out.evicted_keys)
        for key in out.evicted_keys:
            del self.ref[key], self.slot[key]
        for key, block_id in zip(to_store, out.store_spec.block_ids.tolist(), strict=True):  # type: ignore[attr-defined]
            self.ref[key] = PENDING
            self.slot[key] = block_id

    @rule(keys=st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=2))
    def store_a_few(self, keys: list[OffloadKey]) -> None:
        """An offer that fits a full tier: longer ones mostly outgrew it and were refused,
        so a victim was seldom chosen."""
        self.prepare_store(keys)

    @rule(keys=st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=2), ok=st.booleans())
    def serve_a_request(self, keys: list[OffloadKey], ok: bool) -> None:
        """A request's whole round, as an engine drives it: looked up until the filter
        admits it, offered, and its write finished (or failed). The filtered machines
        otherwise never filled a tier and evicted from it."""
        self.lookup_until_eligible(keys)
        self.prepare_store(keys)
        self.complete_store([k for k in keys if self.ref.get(k) == PENDING], ok)

    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        ready = sorted(k for k, r in self.ref.items() if r >= 0)
        if not ready:
            return
        keys = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=4))
        spec = self.manager.prepare_load(iter(keys))
        assert spec.block_ids.tolist() == [self.slot[k] for k in keys]  # type: ignore[attr-defined]
        for key in keys:
            self.ref[key] += 1

    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        pinned = sorted(k for k, r in self.ref.items() if r > 0)
        if not pinned:
            return
        keys = data.draw(st.lists(st.sampled_from(pinned), min_size=1, max_size=4))
        over = next((k for i, k in enumerate(keys) if keys[: i + 1].count(k) > self.ref[k]), None)
        if over is not None:  # more releases than pins: refused whole, the earlier ones too
            before = snapshot(self.cpu)
            try:
                self.manager.complete_load(iter(keys))
            except BlockStateError as exc:
                assert exc.key == over
            else:
                raise AssertionError("complete_load released more pins than were taken")
            assert snapshot(self.cpu) == before
            return
        self.manager.complete_load(iter(keys))
        for key in keys:
            self.ref[key] -= 1

    @rule(keys=KEY_LISTS)
    def lookup_until_eligible(self, keys: list[OffloadKey]) -> None:
        """A prefix asked for ``threshold`` times, as repeated requests do: without it the
        filtered machines seldom stored a block, and never filled a tier."""
        for _ in range(self.threshold):
            self.lookup(keys)

    @rule(data=st.data(), success=st.booleans())
    def complete_every_pending_store(self, data: st.DataObject, success: bool) -> None:
        """The writes in flight all finish, in any order: random key lists left blocks
        pending so long that stores were mostly refused and a victim was seldom chosen."""
        pending = [k for k, r in self.ref.items() if r == PENDING]
        self.complete_store(data.draw(st.permutations(pending)), success)

    @rule()
    def complete_every_load(self) -> None:
        """Every pin released: random releases seldom matched the pins, which piled up."""
        pinned = [k for k, r in self.ref.items() for _ in range(r)]
        self.manager.complete_load(iter(pinned))
        for key in pinned:
            self.ref[key] -= 1

    @rule(keys=KEY_LISTS, success=st.booleans())
    def complete_store(self, keys: list[OffloadKey], success: bool) -> None:
        self.manager.complete_store(iter(keys), success)
        for key in dict.fromkeys(keys):
            if self.ref.get(key) == PENDING:
                if success:
                    self.ref[key] = 0
                else:
                    del self.ref[key], self.slot[key]

    @rule(keys=KEY_LISTS)
    def remove_broken(self, keys: list[OffloadKey]) -> None:
        """A lower tier found these blocks' bytes broken: the ready, unpinned ones go, their
        slots free at once, with no event (the caller announces its own removal)."""
        expected = [k for k in dict.fromkeys(keys) if self.ref.get(k) == 0]
        assert self.cpu.remove(iter(keys)) == expected
        for key in expected:
            del self.ref[key], self.slot[key]
        self.replayed.difference_update(expected)

    @rule(key=st.sampled_from(UNIVERSE))
    def bad_calls_change_nothing(self, key: OffloadKey) -> None:
        before = snapshot(self.cpu)
        if self.ref.get(key, PENDING) < 0:
            try:
                self.manager.prepare_load([*[k for k, r in self.ref.items() if r >= 0], key])
            except BlockStateError as exc:
                assert exc.key == key
            else:
                raise AssertionError("prepare_load of a missing or pending key succeeded")
        if self.ref.get(key, 0) <= 0:
            try:
                self.manager.complete_load([key])
            except BlockStateError as exc:
                assert exc.key == key
            else:
                raise AssertionError("complete_load of an unpinned key succeeded")
        assert snapshot(self.cpu) == before

    @invariant()
    def state_matches_model(self) -> None:
        if not hasattr(self, "cpu"):
            return
        held = {k: (b.block_id, b.ref_cnt) for k, b in self.cpu._blocks.items()}
        assert held == {k: (self.slot[k], self.ref[k]) for k in self.ref}
        evictable = {k for k, r in self.ref.items() if r == 0}
        assert self.cpu.num_evictable_blocks(()) == len(evictable)
        assert self.cpu.num_evictable_blocks(UNIVERSE[:2] * 2) == len(evictable - {*UNIVERSE[:2]})
        slots = [block_id for block_id, _ in held.values()]
        assert len(set(slots)) == len(slots)
        assert all(0 <= s < self.capacity for s in slots)
        for event in self.manager.take_events():
            # Each event names the CPU tier and only keys whose state it changes.
            assert event.medium == "CPU" and event.keys
            assert len(set(event.keys)) == len(event.keys)
            if event.removed:
                assert set(event.keys) <= self.replayed
                self.replayed.difference_update(event.keys)
            else:
                assert self.replayed.isdisjoint(event.keys)
                self.replayed.update(event.keys)
        assert self.replayed == {k for k, r in self.ref.items() if r >= 0}

    @invariant()
    def optimiser_follows_a_candidate_and_reports_sane_what_ifs(self) -> None:
        layer = self.manager.backing if self.use_filter else self.manager
        if not isinstance(layer, OptimisingAdmission):
            return
        assert layer.chosen in CANDIDATES
        for figure in layer.whatif():
            if figure.hit_ratio is None:  # nothing sampled yet: unknown, both
                assert figure.writes_per_ref is None
                continue
            assert 0.0 <= figure.hit_ratio <= 1.0 + 1e-9
            assert figure.writes_per_ref is not None and figure.writes_per_ref >= 0.0


SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None)
STACKED = settings(max_examples=25, stateful_step_count=40, deadline=None)
POLICIES = ["lru", "arc", "s3fifo", "sieve", "slru"]
ADMISSIONS = sorted(set(available_admissions()) - set(ADMISSION_ALIASES))
"""Every registered rule (a new one gets its machines without an edit here)."""


def machine(policy: str, use_filter: bool, admission: str = "none") -> type[ManagerMachine]:
    name = f"{policy.upper()}{admission.title()}{'Filtered' if use_filter else ''}Machine"
    attributes = {"policy": policy, "use_filter": use_filter, "admission": admission}
    return type(name, (ManagerMachine,), attributes)


def test_every_shipped_policy_has_a_machine() -> None:
    shipped = {
        name
        for name in available_policies()
        if name not in ALIASES and _POLICIES[name].__module__.startswith("kvoffload.")
    }
    assert sorted(POLICIES) == sorted(shipped)


for _policy in POLICIES:
    for _admission in ADMISSIONS:
        for _filtered in (False, True):
            _machine = machine(_policy, _filtered, _admission)
            _settings = SETTINGS if _admission == "none" else STACKED
            globals()[f"Test{_machine.__name__}"] = _settings(_machine).TestCase
