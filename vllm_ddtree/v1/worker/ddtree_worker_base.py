# SPDX-License-Identifier: Apache-2.0
"""What the GPU and CPU DDTree workers add to vLLM's: a startup check that a
hybrid target's per-request recurrent states fit (:func:`check_state_budget`)
and, once the engine is warm, the latency model behind adaptive budgets.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import KVCacheSpec, MambaSpec

logger = init_logger(f"vllm.{__name__}")

_GIB = 1 << 30


def check_state_budget(
    vllm_config: Any, kv_cache_spec: dict[str, KVCacheSpec], available: int
) -> None:
    """Fail at startup if one request's recurrent states do not fit.

    vLLM keeps ``1 + num_speculative_tokens`` state slots per request in each
    linear-attention layer (one per tree node, ``B + 1``), so the tree budget
    multiplies their memory; without this check a large budget surfaces as
    vLLM's generic "increase gpu_memory_utilization / decrease max_model_len"
    error, which names neither the cause nor the budget.
    """
    pages = [
        s.page_size_bytes for s in kv_cache_spec.values() if isinstance(s, MambaSpec)
    ]
    if not pages:
        return
    budget = vllm_config.speculative_config.num_speculative_tokens
    per_request = (1 + budget) * sum(pages)
    max_seqs = vllm_config.scheduler_config.max_num_seqs
    logger.info(
        "DDTree: recurrent states take %.3f GiB per request (%d slots x %d "
        "linear-attention layers); %.2f GiB available for all caches",
        per_request / _GIB,
        1 + budget,
        len(pages),
        available / _GIB,
    )
    if per_request > available:
        raise ValueError(
            f"speculative_config['num_speculative_tokens'] = {budget} (the "
            f"DDTree budget B) needs {per_request / _GIB:.2f} GiB of recurrent "
            f"state per request ({1 + budget} slots in each of {len(pages)} "
            f"linear-attention layers), more than the {available / _GIB:.2f} "
            "GiB available for caches. Lower num_speculative_tokens or raise "
            "gpu_memory_utilization (on CPU: VLLM_CPU_KVCACHE_SPACE)."
        )
    if per_request * max_seqs > available:
        logger.warning(
            "DDTree: the recurrent states of max_num_seqs=%d requests "
            "(%.2f GiB) exceed the cache memory (%.2f GiB); fewer requests "
            "will run at once. Lower num_speculative_tokens or max_num_seqs "
            "to avoid it.",
            max_seqs,
            per_request * max_seqs / _GIB,
            available / _GIB,
        )


class DDTreeWorkerMixin:
    """Mixed in before vLLM's GPU / CPU worker class."""

    def determine_available_memory(self) -> int:
        available = super().determine_available_memory()
        check_state_budget(self.vllm_config, self.get_kv_cache_spec(), available)
        return available

    def compile_or_warm_up_model(self):
        # Before vLLM's warm-up, which ends by arming its JIT monitor: the
        # tree kernels' compiles belong to start-up, not to serving. The KV
        # caches they run on are allocated by now.
        self.model_runner.warm_up_tree_kernels()
        if hint := self.model_runner.uncaptured_full_batch_hint():
            logger.info(hint)
        if hint := self.model_runner.token_budget_hint():
            logger.warning(hint)
        times = super().compile_or_warm_up_model()
        # After CUDA-graph capture, so the model times what decoding runs.
        if self.model_runner.ddtree.adaptive_budget:
            self.model_runner.measure_verify_latency()
        return times
