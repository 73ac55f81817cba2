"""The feedback controller: per-class reuse estimates from ghost returns and expiries.

Each first-seen block that is offered for storing is recorded in a ghost
under a *class* (how its request looked: did it extend a known prefix, is
this its last block). If the key is seen again by a later request before its
record expires, the class scores a return, otherwise an expiry. A class whose
recent return rate reaches ``threshold`` has its first-seen blocks admitted.
Counts are halved every ``window`` outcomes, so the estimates follow a
workload that shifts.
"""

from __future__ import annotations

from kvoffload.core.errors import InvalidArgumentError

PRIOR_RETURNS = 0.9
PRIOR_OUTCOMES = 2.0
"""A class starts just below a threshold of 1/2: nothing is written on first sight until
blocks of its class come back (a single return is enough at the start), so a one-shot scan
never fills the tier while the controller waits for evidence."""


class ReuseController:
    """Return rates of ``num_classes`` classes; ``admits(c)`` is the current decision."""

    def __init__(self, num_classes: int, threshold: float, window: int) -> None:
        if num_classes < 1:
            raise InvalidArgumentError(f"num_classes must be >= 1, got {num_classes}")
        if not 0.0 <= threshold <= 1.0:
            raise InvalidArgumentError(f"threshold must be in [0, 1], got {threshold}")
        if window < 1:
            raise InvalidArgumentError(f"window must be >= 1, got {window}")
        self.threshold = threshold
        self.window = window
        self.returns = [0.0] * num_classes
        self.outcomes = [0.0] * num_classes
        self._since_halving = 0
        self._admits = [self.rate(c) >= threshold for c in range(num_classes)]

    def rate(self, cls: int) -> float:
        """Estimated chance that a first-seen block of class ``cls`` is seen again soon."""
        return (self.returns[cls] + PRIOR_RETURNS) / (self.outcomes[cls] + PRIOR_OUTCOMES)

    def admits(self, cls: int) -> bool:
        return self._admits[cls]

    @property
    def admitting_share(self) -> float:
        """The control value: the share of classes whose first-seen blocks are admitted."""
        return sum(self._admits) / len(self._admits)

    def record(self, cls: int, returned: bool) -> None:
        """One outcome for class ``cls``: its block came back (``True``) or expired."""
        self.outcomes[cls] += 1.0
        if returned:
            self.returns[cls] += 1.0
        self._admits[cls] = self.rate(cls) >= self.threshold
        self._since_halving += 1
        if self._since_halving >= self.window:
            self._halve()

    def _halve(self) -> None:
        self.returns = [r / 2 for r in self.returns]
        self.outcomes = [o / 2 for o in self.outcomes]
        self._since_halving = 0
