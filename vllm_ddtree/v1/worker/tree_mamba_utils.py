# SPDX-License-Identifier: Apache-2.0
"""Where a tree step's recurrent states live in vLLM's Mamba cache, and
which of them prefix caching keeps (``mamba_cache_mode`` ``"none"`` or
``"align"``; see ``vllm/v1/worker/mamba_utils.py`` for the chain version).

In ``"align"`` mode a request's block table is indexed by position and
its ``1 + num_speculative_blocks`` state slots for a step are the blocks
from ``(seq_len - 1) // block_size`` on. Prefix caching serves the state
after ``k * block_size`` tokens from block ``k - 1``, so whenever the
accepted path passes such a position, the state of the path's node there
must be written into that block. vLLM does this for chains in its
postprocess by accepted-token count, which is not where a tree keeps the
node's state; :func:`aligned_state_targets` gives the tree's version, and
the DDTree runner runs :func:`keep_accepted_counts` in place of vLLM's
postprocess.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor
from vllm.v1.kv_cache_interface import MambaSpec


def state_window(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    spec: MambaSpec,
    mamba_cache_mode: str,
) -> torch.Tensor:
    """``[R, 1 + num_speculative_blocks]`` state slots of the rows of
    ``block_table`` for a step that ends at ``seq_lens`` (column ``j`` is
    node ``j``'s slot, column 0 also the conv slot), in any cache mode."""
    window = mamba_get_block_table_tensor(block_table, seq_lens, spec, mamba_cache_mode)
    return window[:, : 1 + spec.num_speculative_blocks]


def aligned_state_targets(
    block_table: torch.Tensor,
    window: torch.Tensor,
    ctx_len: torch.Tensor,
    seq_lens: torch.Tensor,
    accepted: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For tree rows in ``"align"`` mode: the block that must receive the
    state at the last ``block_size`` multiple the accepted path reached,
    and that state's node count along the path.

    Args:
        block_table: ``[R, max_blocks]`` the rows' block table.
        window: ``[R, 1 + B]`` the rows' state slots (:func:`state_window`).
        ctx_len: ``[R]`` tokens before the root.
        seq_lens: ``[R]`` ``ctx_len`` plus the row's scheduled nodes.
        accepted: ``[R]`` accepted nodes after the root.
        block_size: the Mamba block size.

    Returns:
        ``(dst_slots, path_len)``, both ``[R]``. A row that reaches no new
        multiple, or whose multiple's block is its own window start (the
        whole tree accepted as one chain: the commit writes that state
        there anyway), gets its window start and a path of the root only,
        which copies a state onto itself. No row selection, so nothing
        waits for the device.
    """
    ctx_len, accepted = ctx_len.long(), accepted.long()
    through_root = ctx_len + 1
    aligned = (through_root + accepted) // block_size * block_size
    depth = aligned - through_root
    target_block = aligned // block_size - 1
    window_start = (seq_lens.long() - 1) // block_size
    needed = (depth >= 0) & (target_block != window_start)
    dst = block_table.gather(1, target_block.clamp(min=0)[:, None]).squeeze(1)
    dst_slots = torch.where(needed, dst.to(window.dtype), window[:, 0])
    path_len = torch.where(needed, depth, torch.zeros_like(depth)) + 1
    return dst_slots, path_len


def keep_accepted_counts(
    *,
    num_reqs: int,
    num_accepted_tokens_gpu: torch.Tensor,
    num_accepted_tokens_cpu_tensor: torch.Tensor,
    **_: object,
) -> None:
    """Stand-in for vLLM's ``postprocess_mamba_align_gpu`` under DDTree: the
    runner reports one accepted token per request (the commit moved the
    accepted state to column 0) and writes the aligned states itself, so
    only the counts go to the host for the next step's preprocess."""
    num_accepted_tokens_cpu_tensor[:num_reqs].copy_(
        num_accepted_tokens_gpu[:num_reqs], non_blocking=True
    )
