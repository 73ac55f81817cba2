"""Runs real vLLM engines for the engine tests; started by them with the engine venv's python.

``python driver.py JOB.json OUT.json``. The job names the model, its dtype and a list of
engines, each with its ``kv_connector_extra_config`` (``null``: no connector, the baseline),
optionally its ``block_size`` and ``max_num_batched_tokens`` (chunked prefill), and its steps:
``generate`` (token-id prompts, greedy, with logprobs), ``reset`` (``reset_prefix_cache()``:
the engine's own prefix cache, so the next requests must load from the offload tier) and
``metrics`` (vLLM's ``get_metrics()``, summed over labels), ``server_keys`` (the keys of the
Valkey server on 127.0.0.1 ``port``, with ``password``, once they are ``at_least`` that many
or ``within_s`` has passed: an engine's stores are written after its requests end),
``signal`` (send ``signal``, a name such as ``SIGSTOP``, to process ``pid``: a test's server
frozen or woken between two steps) and ``sleep`` (``seconds``: a deadline let pass). An
engine's ``env`` is set while it runs. Engines run one after another in this process, each
shut down before the next starts. The output has, per engine, its start-up seconds and each
step's result.

Each engine's core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the scheduler
and the worker, and so both halves of the connector, run the same code as in a process of
their own, and each engine starts in 3-5 s instead of 35-60 s of importing vLLM and torch
again on 2 cores. ``test_serve.py`` runs the engine core in its own process, as ``vllm serve``
does. Everything runs under the ``__main__`` guard all the same.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

SAMPLING = {"temperature": 0.0, "max_tokens": 8, "logprobs": 1, "seed": 0}
OUR_LABELS = ("candidate", "capacity_factor", "source", "tier")
"""The labels :func:`metrics` keeps apart: kvoffload's (the what-if gauges', and the lower
tier of its tier counters) and the source tier of vLLM's ``vllm:prompt_tokens_cached_by_source``."""


def kv_transfer_config(extra: dict[str, Any]) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )


def metrics(llm: Any) -> dict[str, float]:
    """Each counter and gauge by name, summed over its label sets (one engine here), and
    each one labelled with kvoffload's own labels also as ``name{label=value,...}``."""
    values: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            values[metric.name] = values.get(metric.name, 0.0) + float(value)
            ours = sorted((k, v) for k, v in metric.labels.items() if k in OUR_LABELS)
            if ours:
                labels = ",".join(f"{k}={v}" for k, v in ours)
                values[f"{metric.name}{{{labels}}}"] = float(value)
    return values


def generate(llm: Any, prompts: list[list[int]]) -> dict[str, Any]:
    from vllm import SamplingParams, TokensPrompt

    start = time.perf_counter()
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(**SAMPLING),
        use_tqdm=False,
    )
    seconds = time.perf_counter() - start
    settle(llm)
    tokens, logprobs = [], []
    for output in outputs:
        completion = output.outputs[0]
        tokens.append(list(completion.token_ids))
        steps = zip(completion.logprobs, completion.token_ids, strict=True)
        logprobs.append([step[token].logprob for step, token in steps])
    return {"tokens": tokens, "logprobs": logprobs, "seconds": seconds}


def settle(llm: Any, within_s: float = 120.0) -> None:
    """Step the engine while its scheduler still holds requests: finished ones whose stores
    are under way. An engine core in a process of its own steps by itself until then, between
    two calls; in this process ``generate`` stops at the last output, and the rest of its
    stores would complete in the next call's steps instead."""
    core = llm.llm_engine.engine_core.engine_core
    deadline = time.monotonic() + within_s
    while core.scheduler.has_requests():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine still held requests {within_s} s after generate")
        llm.llm_engine.step()


def server_keys(port: int, password: str | None, at_least: int, within_s: float) -> int:
    """The server's key count, waited for: the write-through of a request's last blocks goes
    out after ``generate`` returned, so a step right after it could find them missing."""
    import valkey

    client = valkey.Valkey("127.0.0.1", port, password=password, socket_timeout=5)
    try:
        deadline = time.monotonic() + within_s
        while (keys := int(client.dbsize())) < at_least and time.monotonic() < deadline:
            time.sleep(0.05)
        return keys
    finally:
        client.close()


def run_engine(model: str, dtype: str, engine: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM

    extra = engine.get("extra")
    kwargs: dict[str, Any] = {}
    if "max_num_batched_tokens" in engine:  # prefill in chunks of this many tokens
        kwargs["max_num_batched_tokens"] = engine["max_num_batched_tokens"]
    if extra is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config(extra)
    start = time.perf_counter()
    llm = LLM(
        model=model,
        dtype=dtype,
        block_size=engine.get("block_size", 32),
        max_model_len=2048,
        max_num_seqs=8,
        seed=0,
        enforce_eager=True,
        disable_log_stats=False,
        **kwargs,
    )
    result: dict[str, Any] = {"startup_seconds": time.perf_counter() - start, "steps": []}
    try:
        for step in engine["steps"]:
            if step["do"] == "generate":
                result["steps"].append(generate(llm, step["prompts"]))
            elif step["do"] == "reset":
                result["steps"].append({"reset": llm.reset_prefix_cache()})
            elif step["do"] == "metrics":
                result["steps"].append({"metrics": metrics(llm)})
            elif step["do"] == "server_keys":
                args = (step["port"], step["password"], step["at_least"], step["within_s"])
                result["steps"].append({"server_keys": server_keys(*args)})
            elif step["do"] == "signal":
                os.kill(step["pid"], signal.Signals[step["signal"]])
                result["steps"].append({"signal": step["signal"]})
            elif step["do"] == "sleep":
                time.sleep(step["seconds"])
                result["steps"].append({"sleep": step["seconds"]})
            else:
                raise ValueError(f"unknown step {step['do']!r}")
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    return result


def main(job_path: str, out_path: str) -> None:
    # Read when vLLM and torch start: the engine cores in this process, each on one OpenMP
    # thread, as in the worker process vLLM would start (VLLM_CPU_OMP_THREADS_BIND=0): the
    # baseline's and the offloading engines' logprobs are then bit-identical.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["OMP_NUM_THREADS"] = "1"
    job = json.loads(Path(job_path).read_text())
    results = []
    for engine in job["engines"]:
        # An engine's own environment (a password kept out of its config), which the
        # processes it spawns inherit; the next engine starts without it.
        env = engine.get("env", {})
        os.environ.update(env)
        try:
            results.append(run_engine(job["model"], job["dtype"], engine))
        finally:
            for name in env:
                os.environ.pop(name, None)
    Path(out_path).write_text(json.dumps({"engines": results}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
