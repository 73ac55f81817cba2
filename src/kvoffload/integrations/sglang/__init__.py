"""kvoffload inside SGLang 0.5.23 as a HiCache L3 storage backend; SGLang is imported on first use.

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "kvoffload", "module_path": "kvoffload.integrations.sglang",
      "class_name": "KVOffloadStorage", "interface_v1": 1,
      "kvoffload.remote_url": "redis://127.0.0.1:6379/0"}'

The keys are in :mod:`.settings`; the backend is :mod:`.storage`.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "KVOffloadStorage":
        from kvoffload.integrations.sglang.storage import KVOffloadStorage

        return KVOffloadStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
