# SPDX-License-Identifier: Apache-2.0
"""The scheduler hook that registers processed blocks before
``allocate_slots`` frees align-mode state blocks (plugin hook 10)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
from vllm.v1.core.kv_cache_manager import KVCacheManager

from vllm_ddtree.v1.core.align_state_caching import cache_computed_blocks_first


class _Manager:
    """Records the order of ``cache_blocks`` and ``allocate_slots`` calls;
    ``allocate_slots`` has vLLM's parameters (checked below)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.coordinator = SimpleNamespace(
            cache_blocks=lambda request, n: self.events.append(("cache", n))
        )

    def allocate_slots(
        self,
        request,
        num_new_tokens,
        num_new_computed_tokens=0,
        new_computed_blocks=None,
        num_lookahead_tokens=0,
        num_external_computed_tokens=0,
        delay_cache_blocks=False,
        num_encoder_tokens=0,
        full_sequence_must_fit=False,
        reserved_blocks=0,
        has_scheduled_reqs=True,
    ):
        self.events.append(("allocate", num_new_tokens))
        return "blocks"


def test_fake_manager_has_vllms_parameters():
    ours = list(inspect.signature(_Manager.allocate_slots).parameters)
    theirs = list(inspect.signature(KVCacheManager.allocate_slots).parameters)
    assert ours == theirs


@pytest.mark.parametrize(
    ("computed", "in_flight", "tokens", "cached"),
    [(40, 0, 41, 40), (40, 9, 41, 31), (70, 0, 64, 64), (3, 9, 20, 0)],
)
def test_caches_processed_tokens_before_allocating(
    computed: int, in_flight: int, tokens: int, cached: int
):
    manager = _Manager()
    cache_computed_blocks_first(manager)
    request = SimpleNamespace(
        num_computed_tokens=computed,
        num_in_flight_tokens=in_flight,
        num_tokens=tokens,
    )
    assert manager.allocate_slots(request, 16, num_lookahead_tokens=4) == "blocks"
    assert manager.events == [("cache", cached), ("allocate", 16)]


@pytest.mark.parametrize("by_keyword", [True, False])
def test_delayed_caching_is_left_to_vllm(by_keyword: bool):
    manager = _Manager()
    cache_computed_blocks_first(manager)
    request = SimpleNamespace(
        num_computed_tokens=40, num_in_flight_tokens=0, num_tokens=41
    )
    if by_keyword:
        manager.allocate_slots(request, 8, delay_cache_blocks=True)
    else:
        manager.allocate_slots(request, 8, 0, None, 0, 0, True)
    assert manager.events == [("allocate", 8)]
