# SPDX-License-Identifier: Apache-2.0
"""The accepted-path commit of every Gated DeltaNet layer in two launches,
after the Triton tree ops (:mod:`.triton_tree_gdn`).

The layers' caches are addressed through a table of base addresses (as in
:mod:`.triton_kv_commit`) and the path arithmetic happens inside the
kernels, reading ``path`` / ``path_len`` from the device, so the commit is
one launch for the recurrent states and one for the conv histories, with
no host work per step. The conv part does what the torch reference,
:func:`~vllm_ddtree.v1.ops.tree_gdn.commit_tree_state`, does; the recurrent
part differs, as the Triton recurrence stores no per-node states:

* Recurrent state: the state after the path's first ``n`` nodes is rebuilt
  from the committed one, ``S = exp(G_last) S0 + sum_j exp(G_last - G_j)
  u_j k_j^T`` over those nodes, from the records the tree recurrence left
  (:func:`~vllm_ddtree.v1.ops.triton_tree_gdn.node_record_layout`). One
  program per (request, layer, head, V block) reads its block of ``S0``
  and writes the result in place, or to the destination slot (prefix
  caching's block-boundary states, which lie before the step's slots, so
  they never overwrite records). A destination equal to the committed slot
  means nothing to write.
* Conv history: the new history is the last ``W - 1`` entries of
  ``history[1:] ++ inputs along the path`` (see the reference). A program
  owns one request's slice of channels; it reads all ``W - 1`` source
  columns, then writes, so an in-place move within the slot is safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.v1.ops.triton_kv_commit import address_table
from vllm_ddtree.v1.ops.triton_tree_gdn import (
    node_record_base,
    node_record_layout,
    slot_memory_is_dense,
)


@triton.jit
def _path_end(PATH, PATH_LEN, r, stride_path_r):
    """Request ``r``'s node count along its path and its last node."""
    n = tl.load(PATH_LEN + r).to(tl.int64)
    return n, tl.load(PATH + r * stride_path_r + n - 1).to(tl.int64)


@triton.jit
def _commit_ssm_kernel(
    TABLE,  # [L] int64: each layer's recurrent-state cache
    ANCHOR,  # the first layer's cache: only its element type is used
    STATE_IDX,  # [R, N]: the committed state in column 0, records after it
    DST_SLOTS,  # [R] destination slots (HAS_DST) or unused
    PATH,  # [R, P]
    PATH_LEN,  # [R]
    stride_idx_r,
    stride_idx_c,
    stride_path_r,
    stride_slot,
    stride_h,
    stride_v,
    stride_k,
    HV: tl.constexpr,
    V: tl.constexpr,
    K: tl.constexpr,
    PER_SLOT: tl.constexpr,
    REC: tl.constexpr,
    BV: tl.constexpr,
    BK: tl.constexpr,
    HAS_DST: tl.constexpr,
):
    r = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    hv = tl.program_id(2) // tl.cdiv(V, BV)
    o_v = tl.program_id(2) % tl.cdiv(V, BV) * BV + tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    mask_v, mask_k = o_v < V, o_k < K
    base = tl.load(TABLE + layer).to(tl.pointer_type(ANCHOR.dtype.element_ty))
    n, leaf = _path_end(PATH, PATH_LEN, r, stride_path_r)
    row = STATE_IDX + r * stride_idx_r
    slot = tl.load(row).to(tl.int64)
    dst = tl.load(DST_SLOTS + r).to(tl.int64) if HAS_DST else slot
    # A destination that is the committed slot itself means "nothing to
    # write" (the commit proper comes after and reads that slot).
    keep = mask_v[:, None] & mask_k[None, :]
    if HAS_DST:
        keep = keep & (dst != slot)
    offs = hv * stride_h + o_v[:, None] * stride_v + o_k[None, :] * stride_k
    state = tl.load(base + slot * stride_slot + offs, mask=keep, other=0).to(tl.float32)
    records = (base, row, stride_idx_c, stride_slot)
    leaf_rec = node_record_base(*records, leaf, leaf >= 0, PER_SLOT, REC)
    g_leaf = tl.load(leaf_rec + HV * V + hv).to(tl.float32)
    state *= tl.exp(g_leaf)
    for p in range(0, n):
        node = tl.load(PATH + r * stride_path_r + p).to(tl.int64)
        rec = node_record_base(*records, node, node >= 0, PER_SLOT, REC)
        weight = tl.exp(g_leaf - tl.load(rec + HV * V + hv).to(tl.float32))
        u = tl.load(rec + hv * V + o_v, mask=mask_v, other=0).to(tl.float32)
        key = tl.load(rec + HV * V + HV + hv * K + o_k, mask=mask_k, other=0)
        state += (weight * u)[:, None] * key.to(tl.float32)[None, :]
    tl.store(
        base + dst * stride_slot + offs, state.to(ANCHOR.dtype.element_ty), mask=keep
    )


@triton.jit
def _commit_conv_kernel(
    TABLE,  # [L] int64: each layer's conv cache, logical [slots, dim, cols]
    ANCHOR,
    STATE_IDX,  # [R, N]: column 0 is the conv slot
    DST_SLOTS,  # [R] destination slots (HAS_DST) or unused
    PATH,  # [R, P]
    PATH_LEN,  # [R]
    dim,
    stride_idx_r,
    stride_path_r,
    stride_slot,
    stride_c,
    stride_l,
    W: tl.constexpr,
    HAS_DST: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    r = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    base = tl.load(TABLE + layer).to(tl.pointer_type(ANCHOR.dtype.element_ty))
    n, _ = _path_end(PATH, PATH_LEN, r, stride_path_r)
    src = tl.load(STATE_IDX + r * stride_idx_r).to(tl.int64)
    dst = tl.load(DST_SLOTS + r).to(tl.int64) if HAS_DST else src
    # Entry j of the new history is entry n - 1 + j of history[1:] ++ path
    # inputs: a kept history column, or the input of path node
    # n - 1 + j - (W - 2), stored in column W - 2 + node.
    j = tl.arange(0, BLOCK_W)
    seq = n - 1 + j
    on_path = seq >= W - 2
    node = tl.load(
        PATH + r * stride_path_r + seq - (W - 2), mask=(j < W - 1) & on_path, other=0
    ).to(tl.int64)
    col = tl.where(on_path, W - 2 + node, seq)
    keep = (c < dim)[:, None] & (j < W - 1)[None, :]
    channels = base + c[:, None] * stride_c
    history = tl.load(channels + src * stride_slot + col[None, :] * stride_l, mask=keep)
    # Every column is read before any is overwritten (dst may be src).
    tl.debug_barrier()
    tl.store(channels + dst * stride_slot + j[None, :] * stride_l, history, mask=keep)


class GDNStateCommit:
    """The accepted paths' commit over many layers at once (see the module
    docstring).

    Built once per Mamba KV-cache group (:meth:`for_layers`) from caches that
    share shape, strides, dtype and device (a group's layers do); it keeps
    them alive and their base addresses in device tables.
    """

    @classmethod
    def for_layers(
        cls, conv_states: list[torch.Tensor], ssm_states: list[torch.Tensor]
    ) -> GDNStateCommit | None:
        """The commit of these layers (conv caches as logical ``[slots, dim,
        cols]`` views), or ``None`` when they are not of one geometry each,
        with every recurrent-state slot in one dense block of memory."""
        for caches in (conv_states, ssm_states):
            geometries = {(t.shape, t.stride(), t.dtype, t.device) for t in caches}
            if len(geometries) != 1:
                return None
        if not slot_memory_is_dense(ssm_states[0]):
            return None
        return cls(conv_states, ssm_states)

    def __init__(
        self, conv_states: list[torch.Tensor], ssm_states: list[torch.Tensor]
    ) -> None:
        self.conv_states, self.ssm_states = conv_states, ssm_states
        self.conv_table = address_table(conv_states)
        self.ssm_table = address_table(ssm_states)
        conv = conv_states[0]
        self.dim = conv.shape[1]
        self.block_c = min(triton.next_power_of_2(self.dim), 256)
        self.heads, self.head_v, self.head_k = ssm_states[0].shape[1:]
        self.record, self.per_slot = node_record_layout(ssm_states[0])
        self.block_v = min(triton.next_power_of_2(self.head_v), 32)
        self.block_k = triton.next_power_of_2(self.head_k)

    def __call__(
        self,
        state_indices: torch.Tensor,
        path: torch.Tensor,
        path_len: torch.Tensor,
        width: int,
        dst_slots: torch.Tensor | None = None,
    ) -> None:
        """Commit every layer; arguments as in ``commit_tree_state`` (the
        conv slot in column 0 of ``state_indices``). With ``dst_slots``,
        call it before the commit proper, which overwrites column 0."""
        num_reqs = state_indices.shape[0]
        if num_reqs == 0:
            return
        path = path.contiguous()
        has_dst = dst_slots is not None
        # Without destinations the kernels never read DST_SLOTS: any device
        # tensor fills the argument.
        dst = dst_slots if has_dst else path_len
        num_layers = len(self.ssm_states)
        ssm, conv = self.ssm_states[0], self.conv_states[0]
        grid = (
            num_reqs,
            num_layers,
            self.heads * triton.cdiv(self.head_v, self.block_v),
        )
        _commit_ssm_kernel[grid](
            self.ssm_table, ssm, state_indices, dst, path, path_len,
            *state_indices.stride(), path.stride(0), *ssm.stride(),
            HV=self.heads, V=self.head_v, K=self.head_k, PER_SLOT=self.per_slot,
            REC=self.record, BV=self.block_v,
            BK=self.block_k, HAS_DST=has_dst,
        )  # fmt: skip
        grid = (num_reqs, num_layers, triton.cdiv(self.dim, self.block_c))
        _commit_conv_kernel[grid](
            self.conv_table, conv, state_indices, dst, path, path_len,
            self.dim, state_indices.stride(0), path.stride(0), *conv.stride(),
            W=width, HAS_DST=has_dst, BLOCK_C=self.block_c,
            BLOCK_W=triton.next_power_of_2(width - 1),
        )  # fmt: skip
