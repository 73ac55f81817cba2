"""The feedback controller: per-class reuse estimates from ghost returns and expiries.

Each first-seen block that is offered for storing is recorded in a ghost
under a *class* (how its request looked: did it extend a known prefix, was
that prefix served by the tier, is this its last block) and a *group* (which
root prefix the request starts with: a system prompt, a tool preamble, a
document set). If the key is seen again by a later request before its record
expires, the class and group score a return, otherwise an expiry. A group's
rate is its own counts shrunk towards its class's pooled rate, so a group
with little evidence behaves like its class and one with much follows its
own traffic: in a mix of applications, one whose continuations come back is
admitted while one whose prompts are never reused is not. First-seen blocks
are admitted while that rate reaches ``threshold``. Counts are halved every
``window`` outcomes, so the estimates follow a workload that shifts.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvoffload.admission.params import is_finite, shown
from kvoffload.core.errors import InvalidArgumentError

try:
    from kvoffload.admission._ghost import record_outcomes
except ImportError:  # installed without a C compiler: the Python loop alone
    record_outcomes = None  # type: ignore[assignment]

PRIOR_RETURNS = 0.9
PRIOR_OUTCOMES = 2.0
"""A class starts just below a threshold of 1/2: nothing is written on first sight until
blocks of its class come back (a single return is enough at the start), so a one-shot scan
never fills the tier while the controller waits for evidence."""
GROUP_STRENGTH = 4.0
"""How many outcomes' worth of weight a group gives its class's pooled rate."""
BYTES_PER_COUNT = 8
UNCOUNTED = -1
"""A class whose admitting groups are to be counted again (it had an outcome since)."""


def refused_priors(prior_returns: float, prior_outcomes: float) -> str:
    """The error for more prior returns than prior outcomes: a return rate above 1, which
    admits every first-seen block however few come back until the counts outweigh it."""
    return (
        f"prior_returns ({prior_returns:g}) must not exceed prior_outcomes "
        f"({prior_outcomes:g}): a return rate above 1"
    )


class ReuseController:
    """Return rates of ``num_classes`` classes, each split into ``groups`` groups.

    A *tag* (``tag(cls, group)``) names one class's group; ``admits(tag)`` is
    the current decision for first-seen blocks under it.
    """

    def __init__(
        self,
        num_classes: int,
        threshold: float,
        window: int,
        groups: int = 1,
        prior_returns: float = PRIOR_RETURNS,
        prior_outcomes: float = PRIOR_OUTCOMES,
        group_strength: float = GROUP_STRENGTH,
    ) -> None:
        if num_classes < 1:
            raise InvalidArgumentError(f"num_classes must be >= 1, got {num_classes}")
        if not 0.0 <= threshold <= 1.0:
            raise InvalidArgumentError(f"threshold must be in [0, 1], got {threshold}")
        if window < 1:
            raise InvalidArgumentError(f"window must be >= 1, got {window}")
        if groups < 1:
            raise InvalidArgumentError(f"groups must be >= 1, got {groups}")
        # A rate is (returns + prior) / (outcomes + prior): no prior outcomes divided by
        # zero at the first decision, and a NaN prior never admitted anything.
        for name, value, positive in (
            ("prior_returns", prior_returns, False),
            ("prior_outcomes", prior_outcomes, True),
            ("group_strength", group_strength, False),
        ):
            if not (is_finite(value) and (value > 0 if positive else value >= 0)):
                bound = "> 0" if positive else ">= 0"
                raise InvalidArgumentError(
                    f"{name} must be a finite number {bound}, got {shown(value)}"
                )
        if prior_returns > prior_outcomes:
            raise InvalidArgumentError(refused_priors(prior_returns, prior_outcomes))
        self.threshold = threshold
        self.window = window
        self.prior_returns = prior_returns
        self.prior_outcomes = prior_outcomes
        self.group_strength = group_strength
        self.groups = groups
        self.returns = [0.0] * num_classes
        self.outcomes = [0.0] * num_classes
        self.group_returns = [0.0] * (num_classes * groups)
        self.group_outcomes = [0.0] * (num_classes * groups)
        self._since_halving = 0
        self._admitting = [UNCOUNTED] * num_classes
        """Each class's admitting groups since its last outcome: an engine step's outcomes
        fall in one or two classes, so a busy step's share counts those classes only."""

    @property
    def memory_bytes(self) -> int:
        return BYTES_PER_COUNT * 2 * (len(self.outcomes) + len(self.group_outcomes))

    def tag(self, cls: int, group: int = 0) -> int:
        return cls * self.groups + group

    def class_rate(self, cls: int) -> float:
        """Pooled chance that a first-seen block of class ``cls`` is seen again soon."""
        return (self.returns[cls] + self.prior_returns) / (self.outcomes[cls] + self.prior_outcomes)

    def rate(self, tag: int) -> float:
        """The group's own return rate, shrunk towards its class's pooled rate by
        ``group_strength`` outcomes' weight; a group with no weight at all (no outcomes
        yet, strength 0) has its class's rate."""
        pooled = self.class_rate(tag // self.groups)
        strength = self.group_strength
        weight = self.group_outcomes[tag] + strength
        return (self.group_returns[tag] + strength * pooled) / weight if weight else pooled

    def admits(self, tag: int) -> bool:
        return self.rate(tag) >= self.threshold

    @property
    def admitting_share(self) -> float:
        """The control value: the share of class groups whose first-seen blocks are admitted.
        The engines read it with every stats call (SGLang on each scheduler step), where a
        :meth:`rate` call per group cost 70 us for a layer's 384 groups: each class's count
        is kept until its next outcome, and :meth:`rate` inlined with its pooled rate once."""
        counts = self._admitting
        for cls, count in enumerate(counts):
            if count == UNCOUNTED:
                counts[cls] = self._class_admitting(cls)
        return sum(counts) / len(self.group_outcomes)

    def _class_admitting(self, cls: int) -> int:
        """How many of class ``cls``'s groups admit first-seen blocks."""
        groups, strength, threshold = self.groups, self.group_strength, self.threshold
        group_returns, group_outcomes = self.group_returns, self.group_outcomes
        pooled = self.class_rate(cls)
        admitting = 0
        start = cls * groups
        for tag in range(start, start + groups):
            weight = group_outcomes[tag] + strength
            rate = (group_returns[tag] + strength * pooled) / weight if weight else pooled
            admitting += rate >= threshold
        return admitting

    def record(self, tag: int, returned: bool) -> None:
        """One outcome under ``tag``: its block came back (``True``) or expired."""
        self.record_all((tag,), returned)

    def record_all(self, tags: Iterable[int], returned: bool) -> None:
        """One outcome under each of ``tags`` in turn, all the same (the layer's path: an
        offer's pushed-out and expired records come by the dozen, 55,000 outcomes in a
        Mooncake replay: counted in C where compiled, up to each halving)."""
        if record_outcomes is None:
            self._record_each(tags, returned)
            return
        pending = tags if type(tags) is list else list(tags)
        while pending:
            counts = (
                self._admitting,
                self.outcomes,
                self.group_outcomes,
                self.returns,
                self.group_returns,
                UNCOUNTED,
            )
            done, self._since_halving = record_outcomes(
                pending, returned, self.groups, self.window, self._since_halving, counts
            )
            if self._since_halving >= self.window:
                self._halve()
            pending = pending[done:] if done < len(pending) else []

    def _record_each(self, tags: Iterable[int], returned: bool) -> None:
        """:meth:`record_all` in Python, the reference of the compiled ``record_outcomes``."""
        groups, window = self.groups, self.window
        for tag in tags:
            cls = tag // groups
            self._admitting[cls] = UNCOUNTED
            self.outcomes[cls] += 1.0
            self.group_outcomes[tag] += 1.0
            if returned:
                self.returns[cls] += 1.0
                self.group_returns[tag] += 1.0
            self._since_halving += 1
            if self._since_halving >= window:
                self._halve()

    def _halve(self) -> None:
        self.returns = [r / 2 for r in self.returns]
        self.outcomes = [o / 2 for o in self.outcomes]
        self.group_returns = [r / 2 for r in self.group_returns]
        self.group_outcomes = [o / 2 for o in self.group_outcomes]
        self._since_halving = 0
        self._admitting = [UNCOUNTED] * len(self.returns)
