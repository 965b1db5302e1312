# SPDX-License-Identifier: Apache-2.0
"""Triton kernels of the tree Gated DeltaNet ops (GPU path).

Same signatures, layouts and semantics as the torch versions in
:mod:`vllm_ddtree.v1.ops.tree_gdn` (read that module's docstring first).

* Recurrence: one program per ``(V block, request x value head)``, like
  vLLM's ``fused_sigmoid_gating_delta_rule_update``. It walks the request's
  nodes in order with the float32 state in registers; only when a node's
  parent is not the previous node does it reload the parent's state from the
  parent's slot (stored by this same program earlier, hence the barrier), so
  a chain-shaped tree costs about what vLLM's chain kernel costs (H100,
  batch 1, 24 layers with the conv: 1.50 ms for a 17-node chain, 1.35 ms
  for vLLM's kernels over 16 tokens). Loading the next node's inputs while
  the current node updates the state made it 5-15% slower (tried, dropped).
* Conv: one program per ``(request, channel block)``. Each node's window is
  gathered by walking up to ``W - 1`` parent links (falling back to the
  committed history at the root), a tile of nodes at a time: the nodes are
  independent, so a tile's ``W - 1`` rounds of dependent loads are shared
  by all of its nodes instead of paid node after node. After all nodes are
  done the program rewrites its slice of the slot as ``history[1:] ++
  x(nodes)``. The program owns that slice, so reading before writing needs
  no cross-program sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# ``a`` and ``b`` are slices of the layer's fused projection outputs, whose
# 16-byte alignment depends on the batch's token count for some layouts
# (Qwen3-Next's interleaved one with few value heads): one compiled variant for
# every alignment, the one the start-up warm-up builds (they are read once per
# token and head, so the alignment hint is worth nothing here).
@triton.jit(do_not_specialize_on_alignment=["a", "b"])
def _tree_recurrent_kernel(
    q,
    k,
    v,
    a,
    b,
    A_log,
    dt_bias,
    o,
    state,
    state_indices,
    query_start_loc,
    parents,
    scale,
    softplus_beta,
    softplus_threshold,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_a_t,
    stride_b_t,
    stride_o_t,
    stride_o_h,
    stride_s_slot,
    stride_s_h,
    stride_s_v,
    stride_s_k,
    stride_idx_r,
    stride_idx_c,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_rh = tl.program_id(1)
    r = i_rh // HV
    hv = i_rh % HV
    hk = hv // GROUP
    bos = tl.load(query_start_loc + r).to(tl.int64)
    num_nodes = tl.load(query_start_loc + r + 1).to(tl.int64) - bos

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_v[:, None] & mask_k[None, :]
    h_offs = hv * stride_s_h + o_v[:, None] * stride_s_v + o_k[None, :] * stride_s_k
    idx_row = state_indices + r * stride_idx_r

    neg_A = -tl.exp(tl.load(A_log + hv).to(tl.float32))
    bias = tl.load(dt_bias + hv).to(tl.float32)
    slot = tl.load(idx_row).to(tl.int64)
    b_h = tl.load(state + slot * stride_s_slot + h_offs, mask=mask_h, other=0)
    b_h = b_h.to(tl.float32)

    for t in range(0, num_nodes):
        tok = bos + t
        parent = tl.load(parents + tok)
        if (t > 0) & (parent != t - 1):
            # Branch: continue from the parent's stored state.
            tl.debug_barrier()
            p_slot = tl.load(idx_row + parent * stride_idx_c).to(tl.int64)
            b_h = tl.load(state + p_slot * stride_s_slot + h_offs, mask=mask_h, other=0)
            b_h = b_h.to(tl.float32)

        b_q = tl.load(
            q + tok * stride_q_t + hk * stride_q_h + o_k, mask=mask_k, other=0
        )
        b_k = tl.load(
            k + tok * stride_k_t + hk * stride_k_h + o_k, mask=mask_k, other=0
        )
        b_v = tl.load(
            v + tok * stride_v_t + hv * stride_v_h + o_v, mask=mask_v, other=0
        )
        b_q = b_q.to(tl.float32)
        b_k = b_k.to(tl.float32)
        b_v = b_v.to(tl.float32)
        if USE_QK_L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
        b_q = b_q * scale

        x = tl.load(a + tok * stride_a_t + hv).to(tl.float32) + bias
        softplus = tl.where(
            softplus_beta * x <= softplus_threshold,
            tl.log(1 + tl.exp(softplus_beta * x)) / softplus_beta,
            x,
        )
        beta = tl.sigmoid(tl.load(b + tok * stride_b_t + hv).to(tl.float32))

        b_h *= tl.exp(neg_A * softplus)
        b_v = (b_v - tl.sum(b_h * b_k[None, :], 1)) * beta
        b_h += b_v[:, None] * b_k[None, :]
        b_o = tl.sum(b_h * b_q[None, :], 1)
        tl.store(
            o + tok * stride_o_t + hv * stride_o_h + o_v,
            b_o.to(o.dtype.element_ty),
            mask=mask_v,
        )
        own = tl.load(idx_row + t * stride_idx_c).to(tl.int64)
        tl.store(
            state + own * stride_s_slot + h_offs,
            b_h.to(state.dtype.element_ty),
            mask=mask_h,
        )


def tree_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    parents: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> torch.Tensor:
    """Triton version of :func:`.tree_gdn.tree_gated_delta_rule`."""
    num_tokens, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1], v.shape[2]
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    if scale is None:
        scale = head_k**-0.5
    num_reqs = query_start_loc.shape[0] - 1
    out = torch.empty(num_tokens, num_v_heads, head_v, dtype=v.dtype, device=v.device)
    BK = triton.next_power_of_2(head_k)
    BV = min(triton.next_power_of_2(head_v), 32)
    a2, b2 = a.reshape(num_tokens, -1), b.reshape(num_tokens, -1)
    grid = (triton.cdiv(head_v, BV), num_reqs * num_v_heads)
    _tree_recurrent_kernel[grid](
        q, k, v, a2, b2, A_log, dt_bias, out, ssm_state, state_indices,
        query_start_loc, parents, scale, softplus_beta, softplus_threshold,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a2.stride(0), b2.stride(0), out.stride(0), out.stride(1),
        *ssm_state.stride(), *state_indices.stride(),
        HV=num_v_heads, GROUP=num_v_heads // num_k_heads, K=head_k, V=head_v,
        BK=BK, BV=BV, USE_QK_L2NORM=use_qk_l2norm,
        num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _tree_conv1d_kernel(
    x,
    conv_state,
    weight,
    bias,
    out,
    conv_state_indices,
    query_start_loc,
    parents,
    dim,
    stride_idx_r,
    stride_x_t,
    stride_x_c,
    stride_s_slot,
    stride_s_c,
    stride_s_l,
    stride_w_c,
    stride_w_k,
    stride_o_t,
    stride_o_c,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < dim
    bos = tl.load(query_start_loc + r).to(tl.int64)
    num_nodes = tl.load(query_start_loc + r + 1).to(tl.int64) - bos
    slot = tl.load(conv_state_indices + r * stride_idx_r).to(tl.int64)
    s_base = conv_state + slot * stride_s_slot + c * stride_s_c
    w_base = weight + c * stride_w_c
    if HAS_BIAS:
        b_bias = tl.load(bias + c, mask=cmask, other=0).to(tl.float32)
    else:
        b_bias = tl.zeros([BLOCK_C], dtype=tl.float32)

    # Nodes are independent given their ancestors: BLOCK_T of them at a
    # time, each tile climbing its W - 1 ancestor links together.
    for t0 in range(0, num_nodes, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tmask = t < num_nodes
        tile_mask = tmask[:, None] & cmask[None, :]
        x_t = tl.load(
            x + (bos + t)[:, None] * stride_x_t + c[None, :] * stride_x_c,
            mask=tile_mask,
            other=0,
        )
        w_t = tl.load(w_base + (W - 1) * stride_w_k, mask=cmask, other=0)
        acc = b_bias[None, :] + w_t.to(tl.float32)[None, :] * x_t.to(tl.float32)
        # Walk up the ancestors; past the root, read the committed history
        # from its newest column (W - 2) backwards.
        node = tl.where(tmask, t, -1)
        hist_col = tl.full([BLOCK_T], W - 1, tl.int64)
        for j in tl.static_range(1, W):
            up = tl.load(parents + bos + node, mask=node >= 0, other=-1).to(tl.int64)
            hist_col = tl.where(node >= 0, W - 2, hist_col - 1)
            node = up
            from_x = tl.load(
                x + (bos + node)[:, None] * stride_x_t + c[None, :] * stride_x_c,
                mask=tile_mask & (node >= 0)[:, None],
                other=0,
            )
            from_h = tl.load(
                s_base[None, :] + hist_col[:, None] * stride_s_l,
                mask=tile_mask & (node < 0)[:, None],
                other=0,
            )
            w_j = tl.load(w_base + (W - 1 - j) * stride_w_k, mask=cmask, other=0)
            acc += w_j.to(tl.float32)[None, :] * (
                from_x.to(tl.float32) + from_h.to(tl.float32)
            )
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(
            out + (bos + t)[:, None] * stride_o_t + c[None, :] * stride_o_c,
            acc.to(out.dtype.element_ty),
            mask=tile_mask,
        )

    # All windows are read: the slot becomes history[1:] ++ x(nodes).
    tl.debug_barrier()
    for j in tl.static_range(0, W - 2):
        keep = tl.load(s_base + (j + 1) * stride_s_l, mask=cmask)
        tl.store(s_base + j * stride_s_l, keep, mask=cmask)
    for t0 in range(0, num_nodes, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tile_mask = (t < num_nodes)[:, None] & cmask[None, :]
        x_t = tl.load(
            x + (bos + t)[:, None] * stride_x_t + c[None, :] * stride_x_c,
            mask=tile_mask,
        )
        tl.store(
            s_base[None, :] + (W - 2 + t)[:, None] * stride_s_l,
            x_t.to(conv_state.dtype.element_ty),
            mask=tile_mask,
        )


def tree_causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    conv_state_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    parents: torch.Tensor,
) -> torch.Tensor:
    """Triton version of :func:`.tree_gdn.tree_causal_conv1d_update`."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    num_tokens, dim = x.shape
    width = weight.shape[1]
    assert width >= 2
    out = torch.empty_like(x)
    num_reqs = query_start_loc.shape[0] - 1
    BLOCK_C = min(triton.next_power_of_2(dim), 64)
    grid = (num_reqs, triton.cdiv(dim, BLOCK_C))
    _tree_conv1d_kernel[grid](
        x, conv_state, weight, bias if bias is not None else x, out,
        conv_state_indices, query_start_loc, parents, dim,
        conv_state_indices.stride(0), x.stride(0), x.stride(1),
        *conv_state.stride(), *weight.stride(),
        out.stride(0), out.stride(1),
        W=width, HAS_BIAS=bias is not None, SILU=activation is not None,
        BLOCK_C=BLOCK_C, BLOCK_T=16, num_warps=4,
    )  # fmt: skip
    return out
