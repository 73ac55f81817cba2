"""What the outside world observes of a manager: counters, KV events, Prometheus metrics.

Fed from a manager's calls and ``take_events()`` by :class:`ObservedManager`;
imported by ``sim``, ``cli`` and ``integrations``, never by ``core`` or
``managers``. pyzmq, msgspec and prometheus_client are imported only by the
modules that need them (``publisher`` and ``subscriber``, ``events``, ``metrics``).
"""

from kvoffload.observe.counters import ManagerCounters
from kvoffload.observe.observed import EventSink, ObservedManager, Observers

__all__ = ["EventSink", "ManagerCounters", "ObservedManager", "Observers"]
