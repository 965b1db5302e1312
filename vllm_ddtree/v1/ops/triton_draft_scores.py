# SPDX-License-Identifier: Apache-2.0
"""The drafter's per-row log-normaliser in one pass over its logits.

A tree is built from the top-``B`` log-probabilities of every drafted
position. Log-softmax is monotonic within a row, so those are the top-``B``
logits minus the row's logsumexp: the full-vocabulary work is one top-k of
the logits as they are (bf16) and this kernel, one read of them with an
online max and sum in fp32. The torch form (upcast, log-softmax, top-k of
the fp32 result) reads and writes the ``[rows, vocab]`` block about five
times: at batch 64 with a 152k vocabulary, some 3 GB a step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A row is read in blocks of this many logits.
_BLOCK = 4096


@triton.jit(do_not_specialize=["num_cols", "stride_row"])
def _row_logsumexp_kernel(
    LOGITS,  # [rows, num_cols], any float dtype
    OUT,  # [rows] fp32
    num_cols,
    stride_row,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    row = LOGITS + r * stride_row
    cols = tl.arange(0, BLOCK)
    # Per-lane running max and sum of exp(x - max): one read of the row.
    run_max = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, num_cols, BLOCK):
        x = tl.load(
            row + start + cols, mask=start + cols < num_cols, other=float("-inf")
        )
        x = x.to(tl.float32)
        new_max = tl.maximum(run_max, x)
        # A lane that has only seen -inf keeps a zero sum (no inf - inf).
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - safe) + tl.exp(x - safe)
        run_max = new_max
    top = tl.max(run_max, axis=0)
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(run_sum * tl.exp(run_max - safe_top), axis=0)
    tl.store(OUT + r, safe_top + tl.log(total))


def row_logsumexp_triton(logits: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(logits.float(), dim=-1)`` of a ``[rows, vocab]``
    block whose vocabulary is contiguous, in one launch."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "rows of contiguous logits"
    num_rows, num_cols = logits.shape
    out = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows:
        _row_logsumexp_kernel[(num_rows,)](
            logits,
            out,
            num_cols,
            logits.stride(0),
            BLOCK=min(_BLOCK, triton.next_power_of_2(num_cols)),
        )
    return out


def draft_topk_triton(
    logits: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-``k`` log-probabilities (fp32) and tokens of every row of
    ``logits`` (``[rows, vocab]``, vocabulary contiguous): log-softmax keeps
    a row's order, so they are its top logits minus its logsumexp."""
    values, tokens = logits.topk(k, dim=-1)
    return values.float() - row_logsumexp_triton(logits)[:, None], tokens
