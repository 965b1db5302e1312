# SPDX-License-Identifier: Apache-2.0
"""DDTreeProposer's query buffers cover every (CUDA-graph padded) drafter run.

Regression test for an H200 start-up crash: ``max_num_seqs=4`` with budget 64
sized DFlash's ``positions`` for 4 x 65 = 260 queries, the captured drafter
run padded 260 to the 272-token graph, and RoPE got 272 tokens but only 260
positions.
"""

from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.v1.spec_decode.ddtree_proposer import DDTreeProposer


def _proposer(max_num_seqs: int, budget: int, max_capture: int | None):
    """A proposer with DFlash's buffers as ``DFlashProposer.__init__`` sizes
    them for ``num_speculative_tokens = budget``."""
    proposer = DDTreeProposer.__new__(DDTreeProposer)
    proposer.vllm_config = SimpleNamespace(
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=max_capture)
    )
    proposer.device = torch.device("cpu")
    proposer.max_batch_size = max_num_seqs
    proposer.max_num_tokens = 2048
    proposer.max_query_tokens = max_num_seqs * (1 + budget)
    proposer.max_positions = proposer.max_num_tokens + proposer.max_query_tokens
    proposer.positions = torch.zeros(proposer.max_query_tokens, dtype=torch.int64)
    proposer._slot_mapping_buffer = torch.zeros_like(proposer.positions)
    proposer.arange = torch.arange(proposer.max_positions + 1, dtype=torch.int32)
    return proposer


@pytest.mark.parametrize(
    ("max_num_seqs", "budget", "max_depth", "max_capture"),
    [
        (4, 64, 15, 512),  # the crash: 260 queries padded to 272
        (1, 64, 15, 128),
        (16, 64, 15, 512),
        (4, 4, 15, 128),  # small budget: depth needs more than DFlash sized
        (3, 4, 4, None),  # no CUDA graphs
    ],
)
def test_query_buffers_cover_padded_runs(max_num_seqs, budget, max_depth, max_capture):
    proposer = _proposer(max_num_seqs, budget, max_capture)
    proposer._ensure_query_capacity(max_depth)
    queries = max_num_seqs * (1 + max_depth)
    need = max(queries, max_capture or 0)
    assert proposer.max_query_tokens >= queries
    assert len(proposer.positions) >= need
    assert len(proposer._slot_mapping_buffer) >= need
    # DFlash's invariant: arange covers every position index it hands out.
    assert len(proposer.arange) >= proposer.max_positions + 1
    assert proposer.max_positions >= proposer.max_num_tokens + len(proposer.positions)
