"""Feedback admission: store blocks seen before, and first-seen blocks of classes that return.

Blocks the frequency sketch has seen in an earlier request are admitted, as
the seed filter would (but counted once per request, GPU-held blocks
included). A first-seen block is admitted only if its class has recently
been coming back before the tier would have evicted it: every first-seen
offer, admitted or not, is recorded in a ghost under its class and group; a
record expires once as many blocks as the tier holds have been admitted
since. The :class:`ReuseController` turns returns and expiries into a
decision per class and group. Classes split requests by whether they extend
a known prefix, and if so whether the tier served part of it or only the GPU
cache did, and blocks by whether they end the request; groups split requests
that extend a known prefix by their root (first) block, so that applications
with their own system prompt are judged on their own traffic. One-shot prompts and partial tails
stop being written, continuation turns are written on first sight.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress
from operator import not_

from kvoffload.admission.base import AdmissionLayer, AdmissionStats
from kvoffload.admission.controller import (
    GROUP_STRENGTH,
    PRIOR_OUTCOMES,
    PRIOR_RETURNS,
    ReuseController,
    refused_priors,
)
from kvoffload.admission.ghost import ghost_records
from kvoffload.admission.params import check_params, given_or_default, param
from kvoffload.admission.registry import register_admission
from kvoffload.admission.sketch import FrequencySketch, RequestHashes
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingManager

NUM_CLASSES = 6
ROOT_GROUPS = 64
"""Root prefixes are hashed into this many groups; a shared group only pools evidence."""
DEFAULT_THRESHOLD = 0.5
"""Write a first-seen block when it is more likely than not to be read before it is evicted."""
SAMPLE_FACTOR = 10
"""The sketch remembers about ten tier-fulls of sightings, as W-TinyLFU does."""
MIN_SAMPLE = 1024
BYTES_PER_OPEN_REQUEST = 192
"""Approximate CPython cost of one entry of the layer's open requests (an ordered-dict entry
and a 5-tuple; the key is the engine's), 150 to 190 bytes measured. An optimiser's world
rule never sees the touch or end that closes a request, so its table stays full."""


def first_seen_class(prefix: int, is_last: bool, tier_served: bool = False) -> int:
    """Class of a first-seen block: (no known prefix, a prefix only the GPU cache served,
    one the tier served part of) x (block ends the request)."""
    known = 0 if prefix == 0 else 2 if tier_served else 1
    return 2 * known + (1 if is_last else 0)


def root_group(first: OffloadKey | None, groups: int = ROOT_GROUPS) -> int:
    """The group of a request by its first key (deterministic, unlike ``hash``)."""
    return 0 if first is None else zlib.crc32(first) % groups


@dataclass(frozen=True)
class FeedbackParams:
    """What a user may set of the feedback rule (``--admission-param key=value``)."""

    threshold: float = param(
        DEFAULT_THRESHOLD, 0.0, 1.0, "return rate at which first-seen blocks are written"
    )
    root_groups: int = param(ROOT_GROUPS, 1, 1 << 20, "groups root prefixes are hashed into")
    sample_factor: int = param(SAMPLE_FACTOR, 1, 1000, "sketch sample size in tier-fulls")
    min_sample: int = param(MIN_SAMPLE, 1, 1 << 30, "smallest sketch sample size, in keys")
    prior_returns: float = param(PRIOR_RETURNS, 0.0, help="prior returns of every class")
    prior_outcomes: float = param(PRIOR_OUTCOMES, 1e-9, help="prior outcomes of every class")
    group_strength: float = param(
        GROUP_STRENGTH, 0.0, help="outcomes' weight of the class rate in a group's rate"
    )

    def __post_init__(self) -> None:
        check_params(self, "feedback")
        if self.prior_returns > self.prior_outcomes:  # refused as the parameters are read
            refused = refused_priors(self.prior_returns, self.prior_outcomes)
            raise InvalidArgumentError(f"admission parameters of 'feedback': {refused}")


@register_admission("feedback", params=FeedbackParams)
class FeedbackAdmission(AdmissionLayer):
    """Seen-before blocks always; first-seen blocks per class, from ghost feedback."""

    def __init__(
        self, backing: OffloadingManager, capacity: int, params: FeedbackParams | None = None
    ) -> None:
        super().__init__(backing, capacity)
        self.params = p = given_or_default(params, FeedbackParams, "feedback")
        self.sketch = FrequencySketch(max(p.min_sample, p.sample_factor * capacity))
        self.ghost = ghost_records(capacity)
        self._hashes = RequestHashes()
        self.controller = ReuseController(
            NUM_CLASSES,
            p.threshold,
            window=capacity,
            groups=p.root_groups,
            prior_returns=p.prior_returns,
            prior_outcomes=p.prior_outcomes,
            group_strength=p.group_strength,
        )
        self.written = 0
        """Blocks admitted so far: the clock by which ghost records age."""

    def _sighting(self, keys: Sequence[OffloadKey]) -> None:
        hashes = self._hashes.of_request(keys)
        self.sketch.increment(hashes, self._hashes.cells(self.sketch))
        if len(self.ghost):
            returned = self.ghost.take_all(keys)
            if returned:
                self.controller.record_all(returned, True)
                self.ghost_hits += len(returned)

    def _admit(self, offered: Sequence[OffloadKey], prefix: int) -> list[OffloadKey]:
        hashes, cells = self._hashes.offer(offered, self.sketch)
        seen = self.sketch.seen_at_least(hashes, 2, cells)
        ghost, controller, clock = self.ghost, self.controller, self.written
        expired = ghost.expire(clock - self.capacity)
        if expired:
            controller.record_all(expired, False)
        first, tier_served = self._requests.origin(offered)
        # A request with no known prefix starts a new root, which says nothing: pooled.
        group = root_group(first, self.params.root_groups) if prefix > 0 else 0
        body = controller.tag(first_seen_class(prefix, False, tier_served), group)
        tail = controller.tag(first_seen_class(prefix, True, tier_served), group)
        # The request's first-seen blocks are decided together: by class and group.
        admits_body, admits_tail = controller.admits(body), controller.admits(tail)
        # ``compress`` stops at the body's end: the last key is decided on its own.
        body_keys = offered[:-1]
        pushed = ghost.add_all(list(compress(body_keys, map(not_, seen))), body, clock)
        if not seen[-1]:
            pushed += ghost.add_all(offered[-1:], tail, clock)
        if pushed:
            controller.record_all(pushed, False)
        admitted = list(body_keys) if admits_body else list(compress(body_keys, seen))
        if seen[-1] or admits_tail:
            admitted.append(offered[-1])
        self.written += len(admitted)
        return admitted

    def stats(self) -> AdmissionStats:
        return self._stats(
            self.controller.admitting_share,
            self.sketch.memory_bytes
            + self.ghost.memory_bytes
            + self.controller.memory_bytes
            + self._requests.capacity * BYTES_PER_OPEN_REQUEST,
            self.sketch.sample_size + self.ghost.capacity,
        )
