# SPDX-License-Identifier: Apache-2.0
"""The V2 runner's DDTree speculator on the CPU, without an engine.

vLLM's V2 DFlash speculator needs a GPU, so :class:`DDTreeSpeculator` is
built here without its constructor and given the attributes the DDTree parts
read. Checked: ``_generate_draft`` turns the drafter's positions into the
best-first trees of :func:`build_trees` (on the CPU the shared build is the
torch one; the Triton one is compared with it in
``test_triton_tree_cores.py``); ``propose`` hands DFlash
the target's hidden states path-first (CUDA-graph padding rows untouched),
keeps every request's tree by request-state slot and returns its nodes.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash_module
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from vllm_ddtree.config import DDTreeConfig
from vllm_ddtree.v1.spec_decode.tree import build_trees
from vllm_ddtree.v1.worker.gpu.spec_decode.ddtree import speculator as module
from vllm_ddtree.v1.worker.gpu.spec_decode.ddtree.speculator import DDTreeSpeculator

BUDGET, DEPTH, VOCAB, MAX_REQS = 6, 3, 11, 4


def _speculator(chain_from_batch_size: int | None = None) -> DDTreeSpeculator:
    spec = DDTreeSpeculator.__new__(DDTreeSpeculator)
    spec.ddtree = DDTreeConfig(
        budget=BUDGET,
        max_depth=DEPTH,
        adaptive_budget=False,
        model_runner="v2",
        chain_from_batch_size=chain_from_batch_size,
    )
    spec.num_speculative_steps = DEPTH
    spec._init_tree_buffers(MAX_REQS, BUDGET, torch.device("cpu"))
    spec._accepted_order = None
    # The drafter's "hidden states" are its logits; rows 0..R*DEPTH-1 are the
    # sampled positions in request-major order, as DFlash's kernel lays them.
    # Its combination of the target layers' states: per token, as DFlash's
    # projection is.
    spec.model = SimpleNamespace(
        compute_logits=lambda hidden: hidden,
        combine_hidden_states=lambda states: states.sum(dim=-1, keepdim=True),
    )
    spec.sample_indices = torch.arange(MAX_REQS * DEPTH)
    return spec


@pytest.mark.parametrize("chain_from_batch_size", [None, 2])
def test_generate_draft_builds_best_first_trees(chain_from_batch_size):
    spec = _speculator(chain_from_batch_size)
    num_reqs = 3
    logits = torch.randn(
        MAX_REQS * DEPTH, VOCAB, generator=torch.Generator().manual_seed(0)
    )
    spec._run_model = lambda *args: logits
    spec._generate_draft(num_reqs, num_reqs * (1 + DEPTH), None, None, None)

    logprobs = logits[: num_reqs * DEPTH].log_softmax(dim=-1)
    values, tokens = logprobs.topk(BUDGET, dim=-1)
    expected = build_trees(
        values.view(num_reqs, DEPTH, BUDGET),
        tokens.view(num_reqs, DEPTH, BUDGET),
        BUDGET,
    )
    for name in ("tokens", "parents", "depths", "scores"):
        assert torch.equal(
            getattr(spec.trees, name)[:num_reqs], getattr(expected, name)
        )
    # Rows past the batch keep what they had.
    assert not spec.trees.tokens[num_reqs:].any()
    if chain_from_batch_size is None:
        assert not hasattr(spec, "chain_drafts")
        return
    # With chain steps, DFlash's chains too: the top token of each position
    # (the budget is wider than the chains, whose columns past them stay 0).
    top = logits[: num_reqs * DEPTH].argmax(dim=-1).view(num_reqs, DEPTH)
    assert torch.equal(spec.chain_drafts[:num_reqs, :DEPTH], top)
    assert not spec.chain_drafts[:, DEPTH:].any()
    assert not spec.chain_drafts[num_reqs:].any()


def test_chains_break_ties_as_dflash_does(monkeypatch):
    """A chain's token is DFlash's greedy draft (the argmax: the first of
    tied logits), whatever order the top-k gives tied logits."""
    spec = _speculator(chain_from_batch_size=2)
    logits = torch.zeros(MAX_REQS * DEPTH, VOCAB)
    logits[:, 2] = logits[:, 5] = 1.0
    spec._run_model = lambda *args: logits
    topk = module.draft_topk

    def ties_last_first(logits, k):
        values, tokens = topk(logits, k)
        return values, torch.where(tokens == 2, 5, torch.where(tokens == 5, 2, tokens))

    monkeypatch.setattr(module, "draft_topk", ties_last_first)
    spec._generate_draft(2, 2 * (1 + DEPTH), None, None, None)
    assert (spec.trees.tokens[:2, 0] == 5).all()  # the tree's first child
    assert (spec.chain_drafts[:2, :DEPTH] == 2).all()


def test_chain_batches_propose_chains(monkeypatch):
    """From ``chain_from_batch_size`` requests on, ``propose`` returns the
    chains and keeps each as its request's tree (a node per position, each
    the child of the one before; the budget's other columns children of the
    root); smaller batches return and keep trees."""
    spec = _speculator(chain_from_batch_size=2)
    monkeypatch.setattr(DFlashSpeculator, "propose", lambda *args, **kwargs: None)
    spec.chain_drafts[:] = torch.arange(MAX_REQS * BUDGET).view(MAX_REQS, BUDGET)
    spec.trees.tokens[:] = -spec.chain_drafts
    spec.tree_shapes[:] = 7
    hidden = torch.zeros(8, 2)

    def propose(slots: list[int]) -> torch.Tensor:
        batch = SimpleNamespace(
            num_reqs=len(slots), idx_mapping=torch.tensor(slots, dtype=torch.int32)
        )
        return spec.propose(batch, None, None, hidden, None)

    assert torch.equal(propose([3, 1]), spec.chain_drafts[:2])
    parents, depths = spec.req_tree_shapes
    chain = [0, 1, 2] + [0] * (BUDGET - DEPTH), [1, 2, 3] + [1] * (BUDGET - DEPTH)
    for slot in (3, 1):
        assert (parents[slot].tolist(), depths[slot].tolist()) == chain
    assert torch.equal(propose([0]), spec.trees.tokens[:1])
    assert parents[0].tolist() == [7] * BUDGET and depths[0].tolist() == [7] * BUDGET


@pytest.mark.parametrize("with_aux", [True, False])
def test_propose_reorders_hidden_states_and_keeps_trees_by_slot(monkeypatch, with_aux):
    spec = _speculator()
    seen = {}

    def dflash_propose(self, batch, attn, slots, hidden, aux, *args, **kwargs):
        seen.update(hidden=hidden, aux=aux, args=args, kwargs=kwargs)
        return self.trees.tokens[: batch.num_reqs]

    monkeypatch.setattr(DFlashSpeculator, "propose", dflash_propose)
    for name in ("tokens", "parents", "depths", "scores"):
        getattr(spec.trees, name)[:2] = torch.arange(2 * BUDGET).view(2, BUDGET) + 1
    batch = SimpleNamespace(
        num_reqs=2, idx_mapping=torch.tensor([3, 1], dtype=torch.int32)
    )
    hidden = torch.arange(7.0)[:, None].repeat(1, 2)  # 5 tokens + 2 padding rows
    # Target layers' states, as DFlash concatenates them (when it has them it
    # reads nothing else).
    aux = [hidden + 100, hidden + 200] if with_aux else None
    order = torch.tensor([0, 2, 1, 3, 4])
    permuted = [0, 2, 1, 3, 4, 5, 6]
    spec.set_accepted_order(order)
    drafts = spec.propose(
        batch, None, None, hidden, aux, "num_sampled", dummy_run=False
    )

    if with_aux:
        # Handed over combined and path-first, as the states DFlash reads.
        want = spec.model.combine_hidden_states(torch.cat(aux, dim=-1))[permuted]
        assert seen["aux"] is None
        assert torch.equal(seen["hidden"], want)
    else:
        assert seen["aux"] is None
        assert seen["hidden"][:, 0].tolist() == permuted
    assert seen["args"] == ("num_sampled",) and seen["kwargs"] == {"dummy_run": False}
    assert torch.equal(drafts, spec.trees.tokens[:2])
    req_parents, req_depths = spec.req_tree_shapes
    for slot, row in ((3, 0), (1, 1)):
        assert torch.equal(req_parents[slot], spec.trees.parents[row])
        assert torch.equal(req_depths[slot], spec.trees.depths[row])
    assert not req_parents[[0, 2]].any() and not req_depths[[0, 2]].any()
    # The order is used once: the next proposal keeps vLLM's order.
    spec.propose(batch, None, None, hidden, aux)
    assert seen["hidden"][:, 0].tolist() == list(range(7))
    if with_aux:
        assert torch.equal(torch.cat(seen["aux"], dim=-1), torch.cat(aux, dim=-1))


@pytest.mark.parametrize("rows", [5, 7])
@pytest.mark.parametrize("order_len", [5, 7])
def test_permute_head_leaves_padding(rows, order_len):
    """Orders over the batch's tokens or over the padded batch (identity on
    the padding); hidden states of the batch or of the padded batch."""
    values = torch.arange(float(rows))
    order = torch.tensor([4, 3, 2, 1, 0, 5, 6][:order_len])
    out = module._permute_head(values, order)
    assert out.tolist() == [4, 3, 2, 1, 0] + list(range(5, rows))


def _drafter_graph_descriptors(spec: DDTreeSpeculator) -> list:
    """The decode-graph descriptors vLLM's manager would capture for the
    drafter, built by its own ``_init_candidates`` (the manager's constructor
    needs a distributed group, so the manager is assembled by hand)."""
    manager = CudaGraphManager.__new__(CudaGraphManager)
    manager.vllm_config = spec.vllm_config
    manager.compilation_config = spec.vllm_config.compilation_config
    manager.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    manager.max_num_reqs = MAX_REQS
    manager.decode_query_len = spec.num_query_per_req
    manager.lora_capture_cases = [0]
    manager._candidates, manager._capture_descs = {}, {}
    manager._init_candidates()
    return manager._capture_descs[CUDAGraphMode.FULL]


@pytest.mark.parametrize("hide_schedule", [True, False])
def test_drafter_graphs_ignore_tree_size_schedule(monkeypatch, hide_schedule):
    """Under a batch-size schedule of tree sizes (64 alone, 8 batched) the
    drafter's graphs are still of ``1 + DEPTH`` rows per request; vLLM's own
    reading of the schedule gives negative request counts."""
    spec = _speculator()
    spec.num_query_per_req = 1 + DEPTH
    schedule = [(1, 1, 64), (2, MAX_REQS, 8)]
    spec.vllm_config = SimpleNamespace(
        num_speculative_tokens=64,
        speculative_config=SimpleNamespace(
            num_speculative_tokens_per_batch_size=schedule,
            uses_dynamic_speculative_decoding=lambda: (
                spec.vllm_config.speculative_config.num_speculative_tokens_per_batch_size
                is not None
            ),
        ),
        compilation_config=SimpleNamespace(
            cudagraph_capture_sizes=[1, 2, 4, 8, 16, 24, 32],
            max_cudagraph_capture_size=32,
        ),
    )
    captured = {}
    monkeypatch.setattr(
        DFlashSpeculator,
        "init_cudagraph_manager",
        lambda self, mode: captured.update(descs=_drafter_graph_descriptors(self)),
    )
    if hide_schedule:
        spec.init_cudagraph_manager(CUDAGraphMode.FULL_AND_PIECEWISE)
    else:
        DFlashSpeculator.init_cudagraph_manager(spec, CUDAGraphMode.FULL_AND_PIECEWISE)
    shapes = {(d.num_reqs, d.uniform_token_count) for d in captured["descs"]}
    if hide_schedule:
        # Capture sizes 1..16 rounded up to whole requests of 1 + DEPTH rows.
        assert shapes == {(1, 1 + DEPTH), (2, 1 + DEPTH), (4, 1 + DEPTH)}
        assert (
            spec.vllm_config.speculative_config.num_speculative_tokens_per_batch_size
            is schedule
        )
    else:
        assert any(num_reqs <= 0 for num_reqs, _ in shapes), shapes


@pytest.mark.parametrize(("depth", "max_tokens"), [(3, 1000), (15, 8192)])
def test_warm_up_input_kernel_meets_every_tile(monkeypatch, depth, max_tokens):
    """The tiles DFlash's input preparation compiles (its kernel's
    ``BLOCK_SIZE``) for the warm-up's batches include the tile of every
    query length up to the token budget, as vLLM's own
    ``prepare_dflash_inputs`` picks it (its kernel replaced by a recorder;
    vLLM's CPU stand-in for Triton lacks the rounding it uses)."""
    import triton

    tiles: list[int] = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: tiles.append(kwargs["BLOCK_SIZE"])

    monkeypatch.setattr(dflash_module, "triton", triton)
    monkeypatch.setattr(dflash_module, "_prepare_dflash_inputs_kernel", Recorder())
    calls: list[tuple] = []
    prepare = dflash_module.prepare_dflash_inputs

    def recorded(*args):
        calls.append(args)
        prepare(*args)

    monkeypatch.setattr(dflash_module, "prepare_dflash_inputs", recorded)
    zeros = torch.zeros(4, dtype=torch.int64)
    spec = DDTreeSpeculator.__new__(DDTreeSpeculator)
    spec.__dict__.update(
        input_buffers=SimpleNamespace(
            input_ids=zeros, positions=zeros, query_start_loc=zeros, seq_lens=zeros
        ),
        block_tables=SimpleNamespace(
            slot_mappings=[zeros],
            input_block_tables=[torch.zeros(2, 3, dtype=torch.int32)],
            kernel_block_sizes=[16],
        ),
        draft_kv_cache_group_ids=[0],
        _context_slot_mappings=[zeros],
        context_positions=zeros,
        sample_indices=zeros,
        sample_pos=zeros,
        sample_idx_mapping=zeros,
        parallel_drafting_token_id=0,
        num_query_per_req=1 + depth,
        num_speculative_steps=depth,
        max_num_reqs=2,
        max_num_tokens=max_tokens,
        max_model_len=max_tokens,
        sample_from_anchor=False,
    )
    spec.warm_up_input_kernel(zeros, zeros)
    warmed = set(tiles)
    assert len(calls) == len(tiles) and len(warmed) > 1

    tiles.clear()
    call = inspect.signature(prepare).bind(*calls[0])
    for query_len in range(1, max_tokens + 1):
        call.arguments["input_batch"] = SimpleNamespace(
            num_reqs=1,
            num_scheduled_tokens=np.array([query_len]),
            positions=zeros,
            query_start_loc=zeros,
            idx_mapping=zeros,
        )
        prepare(*call.args, **call.kwargs)
    assert set(tiles) == warmed
