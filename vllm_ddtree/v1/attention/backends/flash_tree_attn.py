# SPDX-License-Identifier: Apache-2.0
"""Tree attention on NVIDIA GPUs: FlashAttention plus a Triton tree pass.

:class:`FlashTreeAttentionBackend` is vLLM's FlashAttention backend (same KV
layout, same kernels for every non-tree row) whose impl, when the batch
carries a published tree, recomputes the tree rows with the Triton kernel
of :mod:`vllm_ddtree.v1.attention.ops.triton_tree_attention`: each node
attends to its request's whole paged context plus its ancestors and itself.
The plugin selects it (as ``CUSTOM``) for ``method: "ddtree"`` targets only;
the DFlash drafter keeps vLLM's own backend.

The tree metadata is host-built per step, so the builder declares CUDA-graph
support only for single-token decode batches: verify batches then run with
piecewise graphs, attention eager. A batch made only of trees skips
FlashAttention: one Triton launch per layer.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)

from vllm_ddtree.v1.attention.backends.tree_attn import (
    PagedKVLayout,
    TreeAttentionImplMixin,
    TreeMetadataBuilderMixin,
)
from vllm_ddtree.v1.attention.ops.triton_tree_attention import tree_attention


class FlashTreeAttentionMetadataBuilder(
    TreeMetadataBuilderMixin, FlashAttentionMetadataBuilder
):
    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


class FlashTreeAttentionImpl(TreeAttentionImplMixin, FlashAttentionImpl):
    def _cache_views(self, kv_cache: torch.Tensor):
        """``[num_blocks, block_size, Hkv, D]`` key and value views."""
        return kv_cache.transpose(1, 2).split(self.head_size, dim=-1)

    def kv_layout(self, kv_cache: torch.Tensor) -> PagedKVLayout:
        return PagedKVLayout.from_strides(*self._cache_views(kv_cache))

    def _tree_forward(self, query, key, value, kv_cache, metadata, tree, output):
        if self.sliding_window != (-1, -1):
            raise NotImplementedError("tree attention does not support sliding windows")
        key_cache, value_cache = self._cache_views(kv_cache)
        packed_mask, mask_row_start = tree.packed_mask
        tree_attention(
            query.view(-1, self.num_heads, self.head_size),
            key_cache,
            value_cache,
            output.view(-1, self.num_heads, self.head_size),
            metadata.tree_block_table,
            tree.q_start,
            tree.num_nodes,
            tree.ctx_len,
            mask_row_start,
            packed_mask,
            self.scale,
            tree.max_nodes,
            max_ctx_len=tree.max_ctx_len,
        )


class FlashTreeAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[FlashTreeAttentionImpl]:
        return FlashTreeAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FlashTreeAttentionMetadataBuilder]:
        return FlashTreeAttentionMetadataBuilder
