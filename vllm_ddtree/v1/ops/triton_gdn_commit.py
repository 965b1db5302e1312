# SPDX-License-Identifier: Apache-2.0
"""The accepted-path commit of every Gated DeltaNet layer in two launches.

:func:`~vllm_ddtree.v1.ops.tree_gdn.commit_tree_state` is the reference:
a dozen indexing ops per layer, so a 24-layer hybrid paid some 300 kernel
launches (and their host time) per step for a few megabytes of copies.
Here the layers' caches are addressed through a table of base addresses
(as in :mod:`.triton_kv_commit`) and the path arithmetic happens inside the
kernels, reading ``path`` / ``path_len`` from the device, so the commit is
one launch for the recurrent states and one for the conv histories, with
no host work per step.

* Recurrent state: request ``r``'s leaf slot is copied whole onto its
  destination slot. No scratch is needed: a request's source and
  destination are its own slots (a copy onto itself when the path ends at
  the root), and requests never share slots.
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


@triton.jit
def _path_end(PATH, PATH_LEN, r, stride_path_r):
    """Request ``r``'s node count along its path and its last node."""
    n = tl.load(PATH_LEN + r).to(tl.int64)
    return n, tl.load(PATH + r * stride_path_r + n - 1).to(tl.int64)


@triton.jit
def _commit_ssm_kernel(
    TABLE,  # [L] int64: each layer's recurrent-state cache
    ANCHOR,  # the first layer's cache: only its element type is used
    STATE_IDX,  # [R, N]: node j's slot in column j
    DST_SLOTS,  # [R] destination slots (HAS_DST) or unused
    PATH,  # [R, P]
    PATH_LEN,  # [R]
    stride_idx_r,
    stride_idx_c,
    stride_path_r,
    stride_slot,
    slot_numel,
    HAS_DST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < slot_numel
    base = tl.load(TABLE + layer).to(tl.pointer_type(ANCHOR.dtype.element_ty))
    _, leaf = _path_end(PATH, PATH_LEN, r, stride_path_r)
    row = STATE_IDX + r * stride_idx_r
    src = tl.load(row + leaf * stride_idx_c).to(tl.int64)
    dst = tl.load(DST_SLOTS + r) if HAS_DST else tl.load(row)
    dst = dst.to(tl.int64)
    state = tl.load(base + src * stride_slot + offs, mask=keep)
    tl.store(base + dst * stride_slot + offs, state, mask=keep)


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
    """:func:`~vllm_ddtree.v1.ops.tree_gdn.commit_tree_state` over many
    layers at once.

    Built once per Mamba KV-cache group (:meth:`for_layers`) from caches that
    share shape, strides, dtype and device (a group's layers do); it keeps
    them alive and their base addresses in device tables.
    """

    @classmethod
    def for_layers(
        cls, conv_states: list[torch.Tensor], ssm_states: list[torch.Tensor]
    ) -> GDNStateCommit | None:
        """The commit of these layers (conv caches as logical ``[slots, dim,
        cols]`` views), or ``None`` when they are not CUDA tensors of one
        geometry each, with every recurrent-state slot contiguous."""
        for caches in (conv_states, ssm_states):
            geometries = {(t.shape, t.stride(), t.dtype, t.device) for t in caches}
            if len(geometries) != 1 or not caches[0].is_cuda:
                return None
        if not ssm_states[0][0].is_contiguous():
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
        self.slot_numel = ssm_states[0][0].numel()
        self.block = min(triton.next_power_of_2(self.slot_numel), 4096)

    def __call__(
        self,
        state_indices: torch.Tensor,
        path: torch.Tensor,
        path_len: torch.Tensor,
        width: int,
        dst_slots: torch.Tensor | None = None,
    ) -> None:
        """Commit every layer; arguments as in ``commit_tree_state`` with
        the conv slot in column 0 of ``state_indices``."""
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
        grid = (num_reqs, num_layers, triton.cdiv(self.slot_numel, self.block))
        _commit_ssm_kernel[grid](
            self.ssm_table, ssm, state_indices, dst, path, path_len,
            *state_indices.stride(), path.stride(0), ssm.stride(0),
            self.slot_numel, HAS_DST=has_dst, BLOCK=self.block,
        )  # fmt: skip
        grid = (num_reqs, num_layers, triton.cdiv(self.dim, self.block_c))
        _commit_conv_kernel[grid](
            self.conv_table, conv, state_indices, dst, path, path_len,
            self.dim, state_indices.stride(0), path.stride(0), *conv.stride(),
            W=width, HAS_DST=has_dst, BLOCK_C=self.block_c,
            BLOCK_W=triton.next_power_of_2(width - 1),
        )  # fmt: skip
