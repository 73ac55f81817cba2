"""vLLM imported once per session (about 10 s), skipped cleanly where it is not installed."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

from vllm_import import import_vllm


@pytest.fixture(scope="session")
def vllm_modules() -> dict[str, ModuleType]:
    return import_vllm()


@pytest.fixture
def instances(vllm_modules: dict[str, ModuleType]) -> Iterator[Callable[..., Any]]:
    """Builds ``vllm_helpers.Instance`` objects with fresh engine ids; shuts them down even
    when a test fails."""
    from vllm_helpers import Instance

    made: list[Instance] = []

    def make(extra: dict[str, Any], **kwargs: Any) -> Instance:
        instance = Instance(extra, f"test-{uuid.uuid4().hex[:12]}", **kwargs)
        made.append(instance)
        return instance

    yield make
    for instance in made:
        instance.close()


@pytest.fixture(scope="module")
def sglang() -> dict[str, ModuleType]:
    """SGLang's storage modules, skipped cleanly where SGLang is not installed."""
    from sglang_helpers import import_sglang

    return import_sglang()


@pytest.fixture
def backends(sglang: dict[str, ModuleType]) -> Iterator[Callable[..., Any]]:
    """Builds SGLang backends (``sglang_helpers.create_backend``); closes them even when a
    test fails."""
    from sglang_helpers import HostPool, create_backend

    made: list[Any] = []

    def make(extra: dict[str, Any], pool: HostPool | None, **kwargs: Any) -> Any:
        backend = create_backend(sglang, extra, pool, **kwargs)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()
