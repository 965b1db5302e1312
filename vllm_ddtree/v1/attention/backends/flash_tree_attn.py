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
piecewise graphs, attention eager.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)

from vllm_ddtree.v1.attention.backends.tree_attn import (
    PagedKVLayout,
    TreeAttentionInfo,
    current_tree,
)
from vllm_ddtree.v1.attention.ops.triton_tree_attention import tree_attention


class FlashTreeAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata.tree = current_tree() if common_attn_metadata.causal is True else None
        return metadata


class FlashTreeAttentionImpl(FlashAttentionImpl):
    def _cache_views(self, kv_cache: torch.Tensor):
        """``[num_blocks, block_size, Hkv, D]`` key and value views."""
        return kv_cache.transpose(1, 2).split(self.head_size, dim=-1)

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output,
        output_scale=None,
        output_block_scale=None,
    ):
        output = super().forward(
            layer,
            query,
            key,
            value,
            kv_cache,
            attn_metadata,
            output,
            output_scale,
            output_block_scale,
        )
        tree: TreeAttentionInfo | None = getattr(attn_metadata, "tree", None)
        if tree is None or self.attn_type != AttentionType.DECODER:
            return output
        if (
            self.sliding_window != (-1, -1)
            or self.alibi_slopes is not None
            or (self.logits_soft_cap)
        ):
            raise NotImplementedError(
                "tree attention supports plain causal attention only (no "
                "sliding window, ALiBi or soft-cap)"
            )
        key_cache, value_cache = self._cache_views(kv_cache)
        tree_attention(
            query.view(-1, self.num_heads, self.head_size),
            key_cache,
            value_cache,
            output.view(-1, self.num_heads, self.head_size),
            attn_metadata.block_table[tree.req_rows.long()],
            tree.q_start,
            tree.num_nodes,
            tree.ctx_len,
            tree.mask_row_start,
            tree.packed_mask,
            self.scale,
            max(tree.num_nodes_cpu),
            max_ctx_len=max(tree.ctx_len_cpu),
        )
        return output

    def copy_kv_slots(
        self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        PagedKVLayout.from_strides(*self._cache_views(kv_cache)).copy_slots(
            kv_cache, src, dst
        )


class FlashTreeAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[FlashTreeAttentionImpl]:
        return FlashTreeAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FlashTreeAttentionMetadataBuilder]:
        return FlashTreeAttentionMetadataBuilder
