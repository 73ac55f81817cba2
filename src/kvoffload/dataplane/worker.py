"""Routes transfers to handlers by the media of their source and destination."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from typing import Protocol

from kvoffload.core.errors import InvalidArgumentError, KVOffloadError
from kvoffload.core.specs import LoadStoreSpec, TransferSpec, TransferType
from kvoffload.dataplane.handlers import OffloadingHandler, TransferResult

logger = logging.getLogger(__name__)

HandlerEntry = tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]


class Closable(Protocol):
    def close(self) -> None: ...


def close_all(resources: Iterable[Closable | None]) -> None:
    """Close each resource (``None``: none there) in order, every one even after an earlier
    close raised, then re-raise the first error.

    A handler's close that fails (a CUDA error left on its stream, an interrupt while it
    waits for a copy) must not leave the others' threads running, nor a shared region's
    file, which holds its memory until the next launch's sweep removes it.
    """
    first: BaseException | None = None
    for resource in resources:
        if resource is None:
            continue
        try:
            resource.close()
        except BaseException as exc:
            if first is None:
                first = exc
            else:
                logger.warning("closing %r failed too", resource, exc_info=True)
    if first is not None:
        raise first


class OffloadingWorker:
    """One handler per ``(source medium, destination medium)`` pair.

    ``transfer_async`` never raises: a refused or failing submission is
    logged and reported as ``False``, so the engine's loop only has to
    handle a result. A job id stays taken, across all handlers, until its
    result is collected: two jobs of one id would report that id finished
    while one of them still runs.
    """

    def __init__(self, handlers: Iterable[HandlerEntry] = ()) -> None:
        self._handlers: dict[TransferType, OffloadingHandler] = {}
        self._in_flight: set[int] = set()
        for src_cls, dst_cls, handler in handlers:
            self.register_handler(src_cls, dst_cls, handler)

    def register_handler(
        self,
        src_cls: type[LoadStoreSpec],
        dst_cls: type[LoadStoreSpec],
        handler: OffloadingHandler,
    ) -> None:
        pair = (src_cls.medium(), dst_cls.medium())
        if pair in self._handlers:
            raise InvalidArgumentError(f"a handler for {pair[0]}->{pair[1]} is already registered")
        self._handlers[pair] = handler

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        try:
            src, dst = spec
            pair = (src.medium(), dst.medium())
        except (TypeError, ValueError, AttributeError):
            logger.warning(
                "job %d: refused, %r is no (source, destination) pair of load/store specs",
                job_id,
                spec,
            )
            return False
        handler = self._handlers.get(pair)
        if handler is None:
            logger.warning("job %d: no handler for %s->%s", job_id, *pair)
            return False
        if job_id in self._in_flight:
            logger.warning("job %d: refused, a job of this id is still in flight", job_id)
            return False
        try:
            submitted = handler.transfer_async(job_id, spec)
        except KVOffloadError as exc:
            # Bad input, or a job after close: the message says why, a traceback would bury it.
            logger.warning("job %d: %s->%s transfer refused: %s", job_id, *pair, exc)
            return False
        except Exception as exc:
            logger.warning(
                "job %d: %s->%s transfer refused: %s: %s",
                job_id,
                *pair,
                type(exc).__name__,
                exc,
                exc_info=True,
            )
            return False
        if not submitted:
            logger.warning("job %d: %s->%s handler declined the transfer", job_id, *pair)
            return False
        self._in_flight.add(job_id)
        return True

    def get_finished(self) -> list[TransferResult]:
        results = [result for h in self._handlers.values() for result in h.get_finished()]
        self._in_flight.difference_update(result.job_id for result in results)
        return results

    def wait(self, job_ids: Collection[int]) -> None:
        for handler in self._handlers.values():
            handler.wait(job_ids)

    def close(self) -> None:
        close_all(self._handlers.values())
