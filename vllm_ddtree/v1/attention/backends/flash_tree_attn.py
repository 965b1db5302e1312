# SPDX-License-Identifier: Apache-2.0
"""Tree attention on NVIDIA GPUs: FlashAttention plus a Triton tree pass.

:class:`FlashTreeAttentionBackend` is vLLM's FlashAttention backend (same KV
layout, same kernels for every non-tree row) whose impl, when the batch
carries a published tree, recomputes the tree rows with the Triton kernel
of :mod:`vllm_ddtree.v1.attention.ops.triton_tree_attention`: each node
attends to its request's whole paged context plus its ancestors and itself.
The plugin selects it (as ``CUSTOM``) for ``method: "ddtree"`` targets only;
the DFlash drafter keeps vLLM's own backend.

CUDA graphs: batches of equal trees (every request verifies
``1 + num_speculative_tokens`` nodes, the steady state with a fixed budget,
or ``1 + K`` nodes for a draft length K of a batch-size schedule) are what
vLLM captures as full graphs (``UNIFORM_BATCH`` support): their tree inputs
live in :class:`~.tree_attn.UniformTreeBuffers`, one per tree size,
refilled by the builder every step. Other verify batches (mixed with
prefills, or trees cut by adaptive budgets) run with piecewise graphs,
attention eager: the batch's metadata keeps one planned tree pass
(``TreePass``) for all its layers. A batch made only of trees skips
FlashAttention's causal pass: one Triton launch per layer, or, with
``ddtree.flash_context``, FlashAttention over the context + a tree-only
Triton pass (see
``flash_context_tree_attention.py``).
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)

from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.v1.attention.backends.tree_attn import (
    PagedKVLayout,
    TreeAttentionImplMixin,
    TreeMetadataBuilderMixin,
    uniform_tree_buffers,
)
from vllm_ddtree.v1.attention.ops.flash_context_tree_attention import (
    flash_context_tree_attention,
)
from vllm_ddtree.v1.attention.ops.triton_tree_attention import (
    TreePass,
    compile_variants,
)

_LAYOUTS: dict[tuple, PagedKVLayout] = {}


class FlashTreeAttentionMetadataBuilder(
    TreeMetadataBuilderMixin, FlashAttentionMetadataBuilder
):
    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH
    # vLLM would reuse one group's metadata for another by swapping in the
    # block table; the tree rows' own table must follow, so build each.
    supports_update_block_table = False

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        cfg = get_ddtree_config(vllm_config)
        self.flash_context = cfg is not None and cfg.flash_context
        if cfg is not None:
            self.uniform_trees = uniform_tree_buffers(vllm_config, device)

    def _skips_stock_pass(self, tree, buffers) -> bool:
        # ``flash_context`` runs FlashAttention over a uniform batch's context.
        if buffers is not None and self.flash_context:
            return False
        return super()._skips_stock_pass(tree, buffers)

    def _attach_tree(self, metadata, common_attn_metadata, tree, buffers) -> bool:
        uniform = super()._attach_tree(metadata, common_attn_metadata, tree, buffers)
        metadata.tree_flash_context = uniform and self.flash_context
        # This batch's tree passes by layer geometry, planned in the first
        # layer of each (see ``TreePass``).
        metadata.tree_passes = {}
        return uniform


def slot_rows(kv_cache: torch.Tensor) -> torch.Tensor | None:
    """``[num_blocks * block_size, Hkv * 2 * D]`` view of a FlashAttention
    cache (logical ``(blocks, Hkv, block_size, 2 * D)``), one row per slot
    holding the slot's keys and values, or ``None`` when the physical layout
    does not keep a slot's heads together (``HND``)."""
    rows = kv_cache.transpose(1, 2)
    if not rows.is_contiguous():
        return None
    return rows.view(rows.shape[0] * rows.shape[1], -1)


class FlashTreeAttentionImpl(TreeAttentionImplMixin, FlashAttentionImpl):
    # The layer's cache and its key and value views (made once: a step with
    # eager attention runs the tree pass in every layer).
    _views: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    def _cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``[num_blocks, block_size, Hkv, D]`` key and value views."""
        if self._views is None or self._views[0] is not kv_cache:
            views = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
            self._views = (kv_cache, views)
        return self._views[1]

    def kv_layout(self, kv_cache: torch.Tensor) -> PagedKVLayout:
        # The index maps depend on the cache's geometry only, and every layer
        # of a KV-cache group shares it: build them once.
        key = (tuple(kv_cache.shape), kv_cache.stride(), kv_cache.device)
        layout = _LAYOUTS.get(key)
        if layout is None:
            layout = _LAYOUTS[key] = PagedKVLayout.from_strides(
                *self._cache_views(kv_cache)
            )
        return layout

    def copy_kv_slots(
        self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        # The accepted-path commit runs for every layer of every step: with
        # the default NHD layout it is one gather and one scatter of rows.
        rows = slot_rows(kv_cache)
        if rows is None:
            super().copy_kv_slots(kv_cache, src, dst)
        else:
            rows[dst] = rows[src]

    def kv_commit_for_layers(self, kv_caches: list[torch.Tensor]):
        # On a GPU, NHD caches of one geometry: one launch for all layers.
        rows = [slot_rows(cache) for cache in kv_caches]
        if not kv_caches or not kv_caches[0].is_cuda or any(r is None for r in rows):
            return None
        # Imported here: only GPU processes need Triton.
        from vllm_ddtree.v1.ops.triton_kv_commit import SlotRowsCommit

        return SlotRowsCommit.for_rows(rows)

    def warm_up_tree_kernels(
        self, kv_cache: torch.Tensor, block_table: torch.Tensor, max_nodes: int
    ) -> None:
        """Compile the tree kernel's variants for trees of up to
        ``max_nodes`` nodes on this layer's cache (see ``compile_variants``)."""
        key_cache, value_cache = self._cache_views(kv_cache)
        compile_variants(key_cache, value_cache, block_table, self.num_heads, max_nodes)

    def _tree_forward(self, query, key, value, kv_cache, metadata, tree, output):
        if self.sliding_window != (-1, -1):
            raise NotImplementedError("tree attention does not support sliding windows")
        key_cache, value_cache = self._cache_views(kv_cache)
        packed_mask, mask_row_start = tree.packed_mask
        args = (
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
        )
        if getattr(metadata, "tree_flash_context", False):
            # A uniform batch: its tokens are the trees' nodes, in order.
            flash_context_tree_attention(
                *args,
                cu_seqlens_q=metadata.query_start_loc,
                max_ctx_len=tree.max_ctx_len,
                fa_version=self.vllm_flash_attn_version,
                num_splits=metadata.max_num_splits,
            )
        else:
            geometry = (self.num_heads, self.head_size, self.scale, kv_cache.shape)
            tree_pass = metadata.tree_passes.get(geometry)
            if tree_pass is None:
                tree_pass = TreePass(*args, max_ctx_len=tree.max_ctx_len)
                metadata.tree_passes[geometry] = tree_pass
            tree_pass(*args[:4])


class FlashTreeAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[FlashTreeAttentionImpl]:
        return FlashTreeAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FlashTreeAttentionMetadataBuilder]:
        return FlashTreeAttentionMetadataBuilder
