# SPDX-License-Identifier: Apache-2.0
"""DDTreeProposer's query buffers cover every (CUDA-graph padded) drafter run.

Regression test for an H200 start-up crash: ``max_num_seqs=4`` with budget 64
sized DFlash's ``positions`` for 4 x 65 = 260 queries, the captured drafter
run padded 260 to the 272-token graph, and RoPE got 272 tokens but only 260
positions.
"""

from types import SimpleNamespace

import numpy as np
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


def _triton_int_class(value: int) -> str:
    """How Triton specialises an integer argument: a variant for 1, one for
    multiples of 16, one for the rest (H100 and the CPU's Triton 3.6)."""
    return "1" if value == 1 else "D" if value % 16 == 0 else ""


@pytest.mark.parametrize(("depth", "max_tokens"), [(3, 1000), (8, 1040), (15, 8192)])
def test_warm_up_input_kernel_meets_every_variant(monkeypatch, depth, max_tokens):
    """The variants of DFlash's input kernel (its ``BLOCK_SIZE`` tile,
    whether rejected counts are given, and Triton's class of every integer
    argument, the batch's token count among them) the warm-up compiles
    include those vLLM's ``set_inputs_first_pass`` launches for every query
    length up to the token budget, in plain and padded batches (the kernel
    replaced by a recorder), with the drafter's ``max_depth`` queries per
    request."""
    import vllm.v1.spec_decode.dflash as dflash_module

    launched: list[tuple] = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(**kwargs):
                ints = tuple(
                    (name, _triton_int_class(value))
                    for name, value in sorted(kwargs.items())
                    if type(value) is int and not name.isupper()
                )
                launched.append(
                    (
                        kwargs["BLOCK_SIZE"],
                        kwargs["HAS_NUM_REJECTED"],
                        kwargs["num_query_per_req"],
                        *ints,
                    )
                )

            return launch

    monkeypatch.setattr(
        dflash_module, "copy_and_expand_dflash_inputs_kernel", Recorder()
    )
    proposer = _proposer(max_num_seqs=2, budget=64, max_capture=None)
    proposer.max_num_tokens = max_tokens
    proposer.ddtree = SimpleNamespace(max_depth=depth)
    proposer.num_speculative_tokens = 64
    proposer.__dict__.update(
        input_ids=None,
        _context_positions_buffer=None,
        _context_slot_mapping_buffer=None,
        parallel_drafting_token_id=0,
        block_size=16,
        token_arange_np=np.arange(4),
        dflash_causal=False,
    )
    block_table = torch.zeros(1, 4, dtype=torch.int32)
    proposer.warm_up_input_kernel(block_table)
    warmed = set(launched)
    assert {key[2] for key in warmed} == {1 + depth}
    assert proposer.num_speculative_tokens == 64  # restored

    launched.clear()
    proposer.num_speculative_tokens = depth  # as ``propose`` sets it
    for query_len in range(1, max_tokens + 1):
        cad = SimpleNamespace(
            batch_size=lambda: 1,
            max_query_len=query_len,
            block_table_tensor=block_table,
            query_start_loc=None,
            seq_lens=torch.zeros(1, dtype=torch.int32),
            seq_lens_cpu_upper_bound=None,
            num_reqs=1,
            max_seq_len=query_len,
        )
        # The batch's token count: the request's, or more with others
        # beside it (the longest query sets the tile); the first count of
        # each of Triton's classes from the query's length on.
        counts: dict[str, int] = {}
        for count in range(query_len, min(query_len + 17, max_tokens + 1)):
            counts.setdefault(_triton_int_class(count), count)
        for count in counts.values():
            for rejected in (None, torch.zeros(1, dtype=torch.int32)):
                proposer.set_inputs_first_pass(
                    torch.zeros(count), None, None, None, None, cad, rejected
                )
    assert set(launched) == warmed
