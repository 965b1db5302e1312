# SPDX-License-Identifier: Apache-2.0
"""Triton forms of the per-step tree cores of :mod:`vllm_ddtree.v1.spec_decode.tree`.

The torch cores are written as a few batched operations per tree depth, so
one step issues well over a hundred tiny kernels; on a GPU each of them costs
a launch (measured on the H200, eager torch: the walk 3.4 ms, the ancestor
mask 1.75 ms per step, whatever the batch size). Here each core is one
launch, one program per request holding the whole tree (at most a few
hundred nodes) in registers. Results are identical to the torch cores, which
stay the CPU path and the tests' oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.v1.spec_decode.tree import WalkResult


@triton.jit
def _walk_kernel(
    NODE_TOKENS,
    PARENTS,
    NUM_NODES,
    TARGET,
    PATH,
    NUM_ACCEPTED,
    BONUS,
    OUT,
    stride_tok,
    stride_par,
    stride_tgt,
    stride_path,
    stride_out,
    max_depth,
    NP: tl.constexpr,
    DP: tl.constexpr,
    WRITE_OUT: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, NP)
    n = tl.load(NUM_NODES + r).to(tl.int32)
    valid = idx < n
    par = tl.load(PARENTS + r * stride_par + idx, mask=valid, other=-2).to(tl.int32)
    tok = tl.load(NODE_TOKENS + r * stride_tok + idx, mask=valid, other=-1)
    tgt = tl.load(TARGET + r * stride_tgt + idx, mask=valid, other=0)
    steps = tl.arange(0, DP)
    path = tl.where(steps == 0, 0, -1)
    cur = n * 0
    done = n * 0
    for step in range(1, max_depth + 1):
        want = tl.sum(tl.where(idx == cur, tgt, 0), axis=0)
        hit = (par == cur) & (tok == want) & (idx > 0) & valid
        nxt = tl.min(tl.where(hit, idx, NP), axis=0)
        found = (nxt < NP) & (done == 0)
        cur = tl.where(found, nxt, cur)
        path = tl.where(steps == step, tl.where(found, nxt, -1), path)
        done = tl.where(found, done, 1)
    accepted = tl.sum(((steps > 0) & (path >= 0)).to(tl.int32), axis=0)
    bonus = tl.sum(tl.where(idx == cur, tgt, 0), axis=0)
    tl.store(PATH + r * stride_path + steps, path, mask=steps <= max_depth)
    tl.store(NUM_ACCEPTED + r, accepted)
    tl.store(BONUS + r, bonus)
    if WRITE_OUT:
        # vLLM's sampler row: the accepted drafted tokens, then the bonus.
        on_step = idx[None, :] == path[:, None]
        path_tok = tl.sum(tl.where(on_step, tok[None, :], 0), axis=1)
        keep = (steps > 0) & (steps <= accepted)
        row = OUT + r * stride_out
        tl.store(row + steps - 1, path_tok, mask=keep)
        tl.store(row + accepted, bonus)


def walk_trees_triton(
    node_tokens: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: torch.Tensor,
    target_tokens: torch.Tensor,
    max_depth: int,
    out: torch.Tensor | None = None,
) -> WalkResult:
    """:func:`~vllm_ddtree.v1.spec_decode.tree.walk_trees` in one launch.

    If ``out`` (``[R, W]``, ``W > `` any accepted length, pre-filled with the
    placeholder) is given, row ``r`` also receives the accepted drafted tokens
    followed by the bonus token: vLLM's sampler-output row.
    """
    num_reqs, n = node_tokens.shape
    device = node_tokens.device
    path = torch.empty(num_reqs, max_depth + 1, dtype=torch.long, device=device)
    num_accepted = torch.empty(num_reqs, dtype=torch.long, device=device)
    bonus = torch.empty(num_reqs, dtype=target_tokens.dtype, device=device)
    if num_reqs:
        _walk_kernel[(num_reqs,)](
            node_tokens,
            parents,
            num_nodes,
            target_tokens,
            path,
            num_accepted,
            bonus,
            out if out is not None else path,
            node_tokens.stride(0),
            parents.stride(0),
            target_tokens.stride(0),
            path.stride(0),
            out.stride(0) if out is not None else 0,
            max_depth,
            NP=triton.next_power_of_2(max(n, 2)),
            DP=triton.next_power_of_2(max_depth + 1),
            WRITE_OUT=out is not None,
        )
    return WalkResult(path=path, num_accepted=num_accepted, bonus=bonus)


@triton.jit
def _ancestor_bits_kernel(
    PARENTS,
    NUM_NODES,
    ROW_START,
    PACKED,
    stride_par,
    stride_packed,
    num_words,
    max_depth,
    NP: tl.constexpr,
    WP: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, NP)
    words = tl.arange(0, WP)
    n = tl.load(NUM_NODES + r).to(tl.int32)
    row0 = tl.load(ROW_START + r).to(tl.int64)
    valid = idx < n
    # Every node climbs its ancestor chain at once, setting one bit a level.
    cur = tl.where(valid, idx, -1)
    bits = tl.zeros((NP, WP), dtype=tl.int32)
    one = tl.full((NP,), 1, dtype=tl.int32)
    for _ in range(max_depth + 1):
        alive = cur >= 0
        safe = tl.maximum(cur, 0)
        hit = alive[:, None] & (words[None, :] == (safe // 32)[:, None])
        bits = bits | tl.where(hit, (one << (safe % 32))[:, None], 0)
        up = tl.load(PARENTS + r * stride_par + safe, mask=alive, other=-1)
        cur = tl.where(alive, up.to(tl.int32), -1)
    ptrs = PACKED + (row0 + idx)[:, None] * stride_packed + words[None, :]
    tl.store(ptrs, bits, mask=valid[:, None] & (words[None, :] < num_words))


def packed_ancestor_mask_triton(
    parents: torch.Tensor,
    num_nodes: torch.Tensor,
    row_start: torch.Tensor,
    total_rows: int,
    max_depth: int,
) -> torch.Tensor:
    """The bit-packed ancestor-or-self masks of
    :func:`~vllm_ddtree.v1.attention.backends.tree_attn.pack_ancestor_mask`,
    straight from the parents (no ``[R, N, N]`` intermediate).

    ``parents`` is ``[R, N]`` (root ``-1``), ``row_start`` the first output
    row of each request, ``total_rows = sum(num_nodes)``; every node's depth
    is at most ``max_depth``.
    """
    num_reqs, n = parents.shape
    num_words = (n + 31) // 32
    packed = torch.empty(
        total_rows, num_words, dtype=torch.int32, device=parents.device
    )
    if num_reqs:
        _ancestor_bits_kernel[(num_reqs,)](
            parents,
            num_nodes,
            row_start,
            packed,
            parents.stride(0),
            packed.stride(0),
            num_words,
            max_depth,
            NP=triton.next_power_of_2(max(n, 2)),
            WP=triton.next_power_of_2(num_words),
        )
    return packed
