# SPDX-License-Identifier: Apache-2.0
"""Tree attention on CPU: vLLM's ``CPU_ATTN`` plus a torch path for trees.

The plugin registers :class:`CPUTreeAttentionBackend` under the
``CPU_ATTN`` name (the CPU platform ignores the selected backend). Without a
published tree it is the stock backend. With one, the stock kernel runs over
the whole batch as usual and the tree rows are then recomputed in torch:
each tree node attends to the request's
whole context (gathered from the paged cache) plus its ancestors and itself,
computed in float32.

The CPU kernels store K/V in ISA-specific packed orders, so the cache layout
is learnt once per shape by writing probe values through the stock
``cpu_attn_reshape_and_cache`` op (:func:`probe_layout`) instead of being
hard-coded here.
"""

from __future__ import annotations

import functools
import math

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from vllm_ddtree.v1.attention.backends.tree_attn import (
    PagedKVLayout,
    TreeAttentionImplMixin,
    TreeAttentionInfo,
    TreeMetadataBuilderMixin,
    torch_tree_attention,
)

# Probe values must be exact in bf16/fp16: integers below 256 are.
_DIGIT_BASE = 64
_EMPTY, _OTHER = -1.0, -3.0


@functools.cache
def probe_layout(
    isa: str, dtype: torch.dtype, block_size: int, num_kv_heads: int, head_size: int
) -> PagedKVLayout:
    """Learn where ``cpu_attn_reshape_and_cache`` puts each K/V element.

    Writes one block's worth of tokens whose values are the base-64 digits
    of each element's ``(head, offset, dim)`` index, one digit per probe, and
    reads back which storage element received which index. K and V are
    probed separately (the other one is written as a marker value).
    """
    numel = num_kv_heads * block_size * head_size
    num_digits = max(1, math.ceil(math.log(numel, _DIGIT_BASE)))
    ids = torch.arange(numel).view(num_kv_heads, block_size, head_size)
    slots = torch.arange(block_size)

    def storage_ids(probe_key: bool) -> torch.Tensor:
        found = torch.zeros(2 * numel, dtype=torch.long)
        for t in range(num_digits):
            digit = (ids // _DIGIT_BASE**t) % _DIGIT_BASE
            probe = digit.transpose(0, 1).to(dtype)  # [block_size, heads, dim]
            marker = torch.full_like(probe, _OTHER)
            cache = torch.full(
                (1, num_kv_heads, block_size, 2 * head_size), _EMPTY, dtype=dtype
            )
            key_cache, value_cache = cache.view(
                1, num_kv_heads, 2 * block_size, head_size
            ).chunk(2, dim=2)
            key, value = (probe, marker) if probe_key else (marker, probe)
            ops.cpu_attn_reshape_and_cache(
                key, value, key_cache, value_cache, slots, isa
            )
            flat = cache.view(-1).float()
            if t == 0:
                hit = (flat != _EMPTY) & (flat != _OTHER)
                if int(hit.sum()) != numel:
                    raise RuntimeError(
                        f"cannot learn the CPU KV-cache layout for isa={isa}"
                    )
            found += torch.where(hit, flat, 0).long() * _DIGIT_BASE**t
        index = torch.empty(numel, dtype=torch.long)
        index[found[hit]] = torch.nonzero(hit).squeeze(1)
        return index.view(num_kv_heads, block_size, head_size)

    return PagedKVLayout(storage_ids(True), storage_ids(False), block_size)


class CPUTreeAttentionMetadataBuilder(
    TreeMetadataBuilderMixin, CPUAttentionMetadataBuilder
):
    pass


class CPUTreeAttentionImpl(TreeAttentionImplMixin, CPUAttentionBackendImpl):
    def kv_layout(self, kv_cache: torch.Tensor) -> PagedKVLayout:
        _, num_kv_heads, block_size, packed = kv_cache.shape
        return probe_layout(
            self.isa, kv_cache.dtype, block_size, num_kv_heads, packed // 2
        )

    def _tree_forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CPUAttentionMetadata,
        tree: TreeAttentionInfo,
        output: torch.Tensor,
    ) -> None:
        if self.sliding_window != -1 or self.sinks is not None or self.is_fp8_kv_cache:
            raise NotImplementedError(
                "CPU tree attention does not support sliding windows, sinks or "
                "an fp8 KV cache."
            )
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        torch_tree_attention(
            query,
            key,
            value,
            kv_cache,
            self.kv_layout(kv_cache),
            metadata.tree_block_table,
            tree,
            self.scale,
            out,
        )


class CPUTreeAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[CPUTreeAttentionImpl]:
        return CPUTreeAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[CPUTreeAttentionMetadataBuilder]:
        return CPUTreeAttentionMetadataBuilder
