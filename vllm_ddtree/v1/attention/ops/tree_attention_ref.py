"""Float64 PyTorch reference for tree attention over a paged KV cache.

Same arguments and semantics as
:func:`vllm_ddtree.v1.attention.ops.triton_tree_attention.tree_attention`:
for each tree row it gathers the row's context and tree keys/values from the
paged cache, builds the dense visibility mask (context always visible, tree
node ``j`` visible to node ``i`` iff bit ``j`` of ``i``'s mask row is set),
and computes softmax attention in float64.  It loops over rows on the host
(one ``.tolist()`` synchronisation), so it is meant for tests and as a slow
CPU fallback, not for production.
"""

from __future__ import annotations

import torch

__all__ = ["tree_attention_reference", "unpack_tree_mask"]


def unpack_tree_mask(words: torch.Tensor, n: int) -> torch.Tensor:
    """Unpack ``[rows, num_words]`` int32 bit masks into ``[rows, n]`` bools."""
    j = torch.arange(n, device=words.device)
    w = words[:, j // 32].to(torch.int64)
    return ((w >> (j % 32)) & 1).bool()


def tree_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    block_table: torch.Tensor,
    q_start: torch.Tensor,
    num_nodes: torch.Tensor,
    ctx_len: torch.Tensor,
    mask_row_start: torch.Tensor,
    tree_mask: torch.Tensor,
    softmax_scale: float,
    max_nodes: int,
    return_lse: bool = False,
    **_unused: object,
) -> torch.Tensor | None:
    """Reference tree attention; writes ``out`` in place (see module doc).

    Returns the natural-log LSE ``[T, Hq]`` float32 if ``return_lse`` (entries
    of tokens outside the tree rows are ``NaN``), else ``None``.  Extra keyword
    arguments of the Triton version (``max_ctx_len``, ``num_splits``) are
    accepted and ignored.
    """
    T, num_q_heads, head_dim = query.shape
    page = key_cache.shape[1]
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    lse = None
    if return_lse:
        lse = torch.full(
            (T, num_q_heads), float("nan"), dtype=torch.float32, device=query.device
        )

    rows = zip(
        q_start.tolist(),
        num_nodes.tolist(),
        ctx_len.tolist(),
        mask_row_start.tolist(),
        strict=True,
    )
    for r, (qs, n, c, m0) in enumerate(rows):
        if n <= 0:
            continue
        assert n <= max_nodes, "num_nodes exceeds max_nodes"
        total = c + n
        pos = torch.arange(total, device=block_table.device)
        blocks = block_table[r, pos // page].long()
        slots = (pos % page).long()
        k = key_cache[blocks, slots].double()  # [L, Hkv, D]
        v = value_cache[blocks, slots].double()
        k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        q = query[qs : qs + n].double()  # [n, Hq, D]

        scores = torch.einsum("nhd,lhd->hnl", q, k) * softmax_scale
        visible = torch.ones(n, total, dtype=torch.bool, device=query.device)
        visible[:, c:] = unpack_tree_mask(tree_mask[m0 : m0 + n], n)
        scores = scores.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [Hq, n]
        probs = torch.exp(scores - row_lse[..., None])
        probs = torch.nan_to_num(probs, nan=0.0)  # rows with nothing visible
        o = torch.einsum("hnl,lhd->nhd", probs, v)
        out[qs : qs + n] = o.to(out.dtype)
        if lse is not None:
            lse[qs : qs + n] = row_lse.transpose(0, 1).float()
    return lse
