# SPDX-License-Identifier: Apache-2.0
"""Gated DeltaNet state ops over token trees (torch; CPU path and reference).

A hybrid target's linear-attention layers keep per-request state: a causal
conv1d window (the last ``W - 1`` inputs) and a recurrent gated-delta-rule
state ``h`` (``[HV, V, K]`` per request). Under a DDTree tree every node must
continue from its *parent's* state, not from the previous token's.

Layouts (the same as vLLM's GDN kernels, so the ops plug into its caches):

* Tokens of the verify batch are grouped per request by ``query_start_loc``
  (``[R + 1]``); token ``bos + i`` is node ``i`` of its request, node 0 the
  root. ``parents[t]`` is the parent node index (local to the request, ``-1``
  for the root), always smaller than the node's own index.
* ``ssm_state`` is ``[num_slots, HV, V, K]`` (a view with other strides is
  fine). ``state_indices[r]`` lists request ``r``'s ``1 + num_spec`` slots:
  the committed state is read from column 0 and the state after node ``i``
  is written to column ``i``. That is vLLM's chain-rollback layout with
  ``num_accepted_tokens = 1``: a chain-shaped tree gives exactly what
  vLLM's ``fused_sigmoid_gating_delta_rule_update`` gives.
* ``conv_state`` is ``[num_slots, dim, state_len]``, ``state_len >= W - 2 +
  nodes``, one slot per request (``conv_state_indices``). Its first ``W - 1``
  columns are the committed history (oldest first). After the step the slot
  holds ``history[1:] ++ x(node 0) ++ ... ++ x(node n-1)``, again vLLM's
  layout for ``num_accepted_tokens = 1``.

:func:`commit_tree_state` then makes the accepted path's final state the
committed one (column 0, conv history in the first ``W - 1`` columns), so
every vLLM code path (non-spec decode, prefill continuation, chain spec
decode with ``num_accepted_tokens = 1``) reads it unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_rows(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Request index of every token (``[T]`` int64)."""
    lengths = (query_start_loc[1:] - query_start_loc[:-1]).long()
    rows = torch.arange(lengths.numel(), device=query_start_loc.device)
    return torch.repeat_interleave(rows, lengths, output_size=num_tokens)


def tree_depths(parents: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """Depth of every token (root 0) from local parent indices (``[T]``)."""
    num_tokens = parents.numel()
    bos = query_start_loc.long()[token_rows(query_start_loc, num_tokens)]
    up = torch.where(parents >= 0, bos + parents.long(), -1)
    depth = torch.zeros(num_tokens, dtype=torch.long, device=parents.device)
    node = up
    while bool((node >= 0).any()):
        depth += (node >= 0).long()
        node = torch.where(node >= 0, up[node.clamp_min(0)], -1)
    return depth


def conv_window_sources(
    parents: torch.Tensor, query_start_loc: torch.Tensor, width: int
) -> torch.Tensor:
    """Where each token's conv window comes from: ``[T, width - 1]`` int64.

    Column ``width - 1 - j`` names the input ``j`` steps up the token's
    ancestor chain: a value ``v >= 0`` is batch token ``v``, a value ``v < 0``
    is column ``-v - 1`` of the request's committed conv history.
    """
    num_tokens = parents.numel()
    bos = query_start_loc.long()[token_rows(query_start_loc, num_tokens)]
    up = torch.where(parents >= 0, bos + parents.long(), -1)
    node = torch.arange(num_tokens, device=parents.device)
    hist = torch.full_like(node, width - 1)  # next history column + 1
    sources = torch.empty(num_tokens, width - 1, dtype=torch.long, device=node.device)
    for j in range(1, width):
        in_tree = node >= 0
        hist = torch.where(in_tree, width - 1, hist) - 1
        node = torch.where(in_tree, up[node.clamp_min(0)], -1)
        sources[:, width - 1 - j] = torch.where(node >= 0, node, -hist - 1)
    return sources


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
    """Causal conv1d of every tree node over its ancestor chain.

    Args:
        x: ``[T, dim]`` this step's inputs (all requests' nodes).
        conv_state: ``[num_slots, dim, state_len]`` history cache (updated).
        weight: ``[dim, W]`` depthwise filter; ``bias``: ``[dim]`` or None.
        activation: ``None`` or ``"silu"`` / ``"swish"``.
        conv_state_indices: ``[R]`` cache slot of each request.
        query_start_loc: ``[R + 1]`` token offsets of the requests.
        parents: ``[T]`` local parent index of each token (-1 for roots).

    Returns:
        ``[T, dim]`` outputs in ``x.dtype``.
    """
    num_tokens, dim = x.shape
    width = weight.shape[1]
    rows = token_rows(query_start_loc, num_tokens)
    slots = conv_state_indices.long()
    history = conv_state[slots, :, : width - 1]  # [R, dim, W-1]
    sources = conv_window_sources(parents, query_start_loc, width)
    from_hist = sources < 0
    tokens = x[sources.clamp_min(0)].to(history.dtype)  # [T, W-1, dim]
    hist_cols = (-sources - 1).clamp_min(0)
    hist_vals = history[rows[:, None], :, hist_cols]  # [T, W-1, dim]
    window = torch.where(from_hist[..., None], hist_vals, tokens)
    window = torch.cat([window, x[:, None, :].to(window.dtype)], dim=1)
    # The same arithmetic as vLLM's CPU decode conv (a depthwise conv in the
    # weight's dtype, activation on its rounded output), so that on CPU a
    # node's output is bit-identical to decoding its path token by token.
    out = F.conv1d(
        window.transpose(1, 2).to(weight.dtype),
        weight[:, None, :],
        bias,
        groups=dim,
    ).squeeze(-1)
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported activation {activation!r}")

    # history[1:] ++ x(node 0) ++ ... for every request.
    local = torch.arange(num_tokens, device=x.device) - query_start_loc.long()[rows]
    conv_state[slots, :, : width - 2] = history[:, :, 1:]
    conv_state[slots[rows], :, width - 2 + local] = x.to(conv_state.dtype)
    return out.to(x.dtype)


def _gating(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    softplus_beta: float,
    softplus_threshold: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token decay ``exp(g)`` and write strength ``sigmoid(b)``."""
    x = a.float() + dt_bias.float()
    softplus = torch.where(
        softplus_beta * x <= softplus_threshold,
        torch.log1p(torch.exp(softplus_beta * x)) / softplus_beta,
        x,
    )
    g = -torch.exp(A_log.float()) * softplus
    return torch.exp(g), torch.sigmoid(b.float())


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
    """Sigmoid-gated delta rule over trees, one state per node.

    Same math as vLLM's ``fused_sigmoid_gating_delta_rule_update`` (float32
    state, ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta =
    sigmoid(b)``, optional L2 norm of q and k), but node ``i`` starts from
    the state after its parent (the root from column 0 of its request's
    ``state_indices`` row) and its own state is written to column ``i``.

    Args:
        q, k: ``[T, H, K]``; v: ``[T, HV, V]``; a, b: ``[T, HV]``.
        A_log, dt_bias: ``[HV]``.
        ssm_state: ``[num_slots, HV, V, K]`` (updated in place).
        state_indices: ``[R, >= max nodes]`` slots of each request's nodes.
        query_start_loc: ``[R + 1]``; parents: ``[T]`` local parent indices.

    Returns:
        ``[T, HV, V]`` outputs in ``v.dtype``.
    """
    num_tokens, num_k_heads, head_k = q.shape
    num_v_heads = v.shape[1]
    group = num_v_heads // num_k_heads
    if scale is None:
        scale = head_k**-0.5
    qf = q.float().repeat_interleave(group, dim=1)
    kf = k.float().repeat_interleave(group, dim=1)
    if use_qk_l2norm:
        qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + 1e-6)
        kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    qf = qf * scale
    decay, beta = _gating(a, b, A_log, dt_bias, softplus_beta, softplus_threshold)

    rows = token_rows(query_start_loc, num_tokens)
    local = torch.arange(num_tokens, device=q.device) - query_start_loc.long()[rows]
    state_indices = state_indices.long()
    own_slot = state_indices[rows, local]
    parent_slot = state_indices[rows, parents.long().clamp_min(0)]
    depth = tree_depths(parents, query_start_loc)
    out = torch.empty(num_tokens, num_v_heads, v.shape[-1], device=v.device)
    # All nodes of one depth are independent: their parents are done.
    for level in range(int(depth.max()) + 1 if num_tokens else 0):
        t = torch.nonzero(depth == level).squeeze(1)
        h = ssm_state[parent_slot[t]].float() * decay[t][..., None, None]
        kt = kf[t]
        delta = (v[t].float() - (h * kt[:, :, None, :]).sum(-1)) * beta[t][..., None]
        h = h + delta[..., None] * kt[:, :, None, :]
        out[t] = (h * qf[t][:, :, None, :]).sum(-1)
        ssm_state[own_slot[t]] = h.to(ssm_state.dtype)
    return out.to(v.dtype)


def commit_tree_state(
    conv_state: torch.Tensor | None,
    ssm_state: torch.Tensor | None,
    conv_state_indices: torch.Tensor,
    state_indices: torch.Tensor,
    path: torch.Tensor,
    path_len: torch.Tensor,
    width: int,
    dst_slots: torch.Tensor | None = None,
) -> None:
    """Make the accepted path's state each request's committed state, or,
    with ``dst_slots``, write the state after the path's first ``path_len``
    nodes into other slots (in vLLM's committed layout) and leave the tree's
    slots as they are.

    Args:
        conv_state / ssm_state: the caches after the tree step (either may
            be None to skip it).
        conv_state_indices: ``[R]`` conv slot; state_indices: ``[R, N]``.
        path: ``[R, P]`` accepted node indices from the root (``path[:, 0]
            == 0``); entries past ``path_len`` are ignored.
        path_len: ``[R]`` nodes on the path, root included (>= 1).
        width: the conv kernel width ``W``.
        dst_slots: ``[R]`` slots that receive both states; by default the
            recurrent state goes to column 0 of ``state_indices`` and the
            conv history stays in ``conv_state_indices`` (the commit).
    """
    path = path.long()
    path_len = path_len.long()
    rows = torch.arange(path.shape[0], device=path.device)
    if ssm_state is not None:
        # A row whose path ends at the root copies a slot onto itself: no
        # mask, so that no row selection waits for the device.
        leaf = path[rows, path_len - 1]
        dst = state_indices[:, 0] if dst_slots is None else dst_slots
        ssm_state[dst.long()] = ssm_state[state_indices.long()[rows, leaf]]
    if conv_state is not None:
        # The conv slot holds history[1:] (W - 2 columns) then the nodes'
        # inputs; the new history is the last W - 1 entries of
        # history[1:] ++ inputs along the path.
        seq = path_len[:, None] - 1 + torch.arange(width - 1, device=path.device)
        on_path = seq >= width - 2
        node = path.gather(1, (seq - (width - 2)).clamp(0, path.shape[1] - 1))
        cols = torch.where(on_path, width - 2 + node, seq)
        src = conv_state_indices.long()[:, None]
        dst = src if dst_slots is None else dst_slots.long()[:, None]
        conv_state[dst, :, torch.arange(width - 1)] = conv_state[src, :, cols]
