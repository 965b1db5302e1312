# SPDX-License-Identifier: Apache-2.0
"""The V2 runner's tree-walk sampler (CPU, Triton interpreted).

:class:`TreeWalkSampler` turns a verify batch's per-node target choices into
V2's sampler output. Here V2's own sampler is replaced by a stub that returns
known choices, so the test checks what DDTree adds: the walk over the
published trees, V2's ``sampled`` / ``num_sampled`` / ``num_rejected``
(prefill rows included) against the torch walk, and the logit rows handed to
V2's logprobs in path order. Like the other Triton tests it runs under
``TRITON_INTERPRET=1`` in one subprocess (this file with ``--worker``). On a
CPU vLLM disables its own Triton kernels, so V2's two that the sampler calls
are replaced: ``get_num_sampled_and_rejected`` by its torch equivalent, and
the logprobs computation by a recorder of the rows it is given.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.test_triton_tree_cores import random_batch
from tests.test_triton_verify_step import committed_rows, random_kv_layers
from tests.utils import interpreted_case, interpreter_fixture, run_case

# name -> (requests, max nodes incl. root, max depth, seed)
CASES: dict[str, tuple[int, int, int, int]] = {
    "mixed": (6, 17, 6, 11),
    "budget-64": (3, 65, 15, 12),
    # Fewer nodes than depths: the rows' columns follow the budget.
    "budget-4": (4, 5, 15, 13),
}


def _stub_sampler(choices: torch.Tensor, prefill_len: torch.Tensor):
    def sample(logits, *args, return_logprobs=False):
        return choices, logits

    return SimpleNamespace(
        compute_nans=False,
        returns_logprobs=lambda idx_mapping_np: True,
        sample=sample,
        logprobs_mode="raw_logprobs",
        req_states=SimpleNamespace(prefill_len=SimpleNamespace(gpu=prefill_len)),
        sampling_states=SimpleNamespace(max_num_logprobs=lambda idx_mapping_np: 0),
    )


def _num_sampled_and_rejected(num_sampled, seq_lens, cu_num_logits, idx, prefill):
    """V2's ``get_num_sampled_and_rejected`` in torch: rows still prefilling
    sample nothing and reject nothing; the others reject every logit row
    past their samples."""
    prefilling = seq_lens < prefill[idx.long()]
    num_logits = (cu_num_logits[1:] - cu_num_logits[:-1]).to(num_sampled.dtype)
    num_sampled = torch.where(prefilling, 0, num_sampled)
    return num_sampled, torch.where(prefilling, 0, num_logits - num_sampled)


def _run(num_reqs: int, max_nodes: int, max_depth: int, seed: int) -> dict:
    from vllm_ddtree.v1.ops.triton_kv_commit import SlotRowsCommit
    from vllm_ddtree.v1.spec_decode.tree import walk_trees
    from vllm_ddtree.v1.worker.gpu.spec_decode.ddtree import rejection_sampler
    from vllm_ddtree.v1.worker.gpu.spec_decode.ddtree.rejection_sampler import (
        TreeWalkInput,
        TreeWalkSampler,
    )
    from vllm_ddtree.v1.worker.host_staging import HostStaging
    from vllm_ddtree.v1.worker.verify_plan import path_first_order_torch, stage_layout

    rejection_sampler.get_num_sampled_and_rejected = _num_sampled_and_rejected
    recorded = {}

    def record_logprob_rows(self, input_batch, sampled, num_sampled, rows):
        recorded["rows"] = rows
        return None

    TreeWalkSampler._get_logprobs_tensors = record_logprob_rows

    tokens, parents, num_nodes, target = random_batch(
        num_reqs, max_nodes, max_depth, seed
    )
    num_nodes[0] = 1  # a row without drafts (a prefill's last chunk)
    parents[0, 1:] = -1
    counts = num_nodes.numpy()
    cu = np.concatenate([[0], np.cumsum(counts)])
    staged = stage_layout(HostStaging("cpu"), counts, cu[1:])
    layout = staged.rows
    # Columns past the widest tree are padding in every row.
    width = layout.logit_rows.shape[1]
    tokens, parents, target = tokens[:, :width], parents[:, :width], target[:, :width]
    num_logits = int(cu[-1])
    # Flattened verify batch: each request's root and nodes, consecutive.
    valid = layout.logit_rows.new_tensor(
        np.arange(width)[None, :] < counts[:, None]
    ).bool()
    input_ids = torch.zeros(num_logits, dtype=torch.long)
    choices = torch.zeros(num_logits, dtype=torch.long)
    input_ids[layout.logit_rows[valid]] = tokens[valid]
    choices[layout.logit_rows[valid]] = target[valid]
    vocab = 50
    logits = torch.randn(
        num_logits, vocab, generator=torch.Generator().manual_seed(seed)
    )
    seq_lens = torch.full((num_reqs,), 100, dtype=torch.int32)
    batch = SimpleNamespace(
        logits_indices=torch.arange(num_logits),
        idx_mapping_np=np.arange(num_reqs, dtype=np.int32),
        idx_mapping=torch.arange(num_reqs, dtype=torch.int32),
        expanded_idx_mapping=None,
        expanded_local_pos=None,
        positions=torch.arange(num_logits),
        input_ids=input_ids,
        num_reqs=num_reqs,
        seq_lens=seq_lens,
        cu_num_logits=torch.from_numpy(cu.astype(np.int32)),
        cu_num_logits_np=cu.astype(np.int32),
        # Two tokens of CUDA-graph padding.
        num_tokens_after_padding=num_logits + 2,
    )
    budget = max_nodes - 1
    spec = SimpleNamespace(
        num_speculative_tokens=budget, rejection_sample_method="standard"
    )
    sampler = TreeWalkSampler(
        _stub_sampler(choices, torch.zeros(num_reqs, dtype=torch.int32)),
        spec,
        "cpu",
        max_depth,
    )
    # Depth positions in, linear positions back out of the walk's launch.
    linear = torch.arange(num_logits + 2)
    positions = linear.clone()
    positions[staged.node_tokens] = staged.root_index[staged.node_rows] + 1
    # The walk's launch also commits the accepted paths' KV.
    g = torch.Generator().manual_seed(seed)
    slots, layers = random_kv_layers(num_logits + 2, g)
    kv_rows = [rows.clone() for rows in layers]
    kv_commit = (SlotRowsCommit.for_rows(kv_rows), slots)
    sampler.step = TreeWalkInput(parents, staged, max_depth, positions, kv_commit)
    out = sampler(logits, batch)
    path_first = sampler.last_walk.path_first

    ref = walk_trees(tokens, parents, num_nodes, target, max_depth)
    # A column per accepted node at most, then the bonus.
    expected = torch.full((num_reqs, min(budget, max_depth) + 1), -1, dtype=torch.long)
    for r in range(num_reqs):
        path = [int(n) for n in ref.path[r, 1:] if n >= 0]
        expected[r, : len(path)] = tokens[r, path]
        expected[r, len(path)] = ref.bonus[r]
    # Row i of request r's span must be the logits of its path's i-th node;
    # the rejected nodes follow in node order.
    order = []
    for r in range(num_reqs):
        path = [int(n) for n in ref.path[r] if n >= 0]
        rest = [n for n in range(int(counts[r])) if n not in path]
        order += [int(cu[r]) + n for n in path + rest]
    ref_order = path_first_order_torch(staged, ref.path, num_logits + 2)
    expected_kv = committed_rows(layers, slots, staged.root_index, ref.path)
    kv_equal = all(
        torch.equal(got, want) for got, want in zip(kv_rows, expected_kv, strict=True)
    )
    return {
        "kv_committed": sampler.last_walk.kv_committed and kv_equal,
        "kv_moved": not torch.equal(expected_kv[0], layers[0]),
        "order_equal": torch.equal(path_first.order, ref_order),
        "positions_restored": torch.equal(positions, linear),
        "sampled_equal": torch.equal(out.sampled_token_ids.long(), expected),
        "num_sampled": out.num_sampled.tolist(),
        "expected_num_sampled": (ref.num_accepted + 1).tolist(),
        "num_rejected": out.num_rejected.tolist(),
        "expected_num_rejected": (num_nodes - ref.num_accepted - 1).tolist(),
        "max_accepted": int(ref.num_accepted.max()),
        "logprob_rows_equal": torch.equal(recorded["rows"], logits[order]),
    }


def _worker() -> None:
    for name, case in CASES.items():
        run_case(name, lambda case=case: _run(*case))


interp_results = interpreter_fixture(__file__, timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_tree_walk_sampler_matches_the_torch_walk(interp_results, name):
    rec = interpreted_case(interp_results, name)
    assert rec["sampled_equal"], rec
    assert rec["num_sampled"] == rec["expected_num_sampled"], rec
    assert rec["num_rejected"] == rec["expected_num_rejected"], rec
    assert rec["max_accepted"] >= 2, rec  # the walks go deep
    assert rec["logprob_rows_equal"], rec
    # The walk's launch also put the paths first, as the torch order does.
    assert rec["order_equal"] and rec["positions_restored"], rec
    # ... and moved the accepted paths' KV in every layer.
    assert rec["kv_committed"] and rec["kv_moved"], rec


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()


@pytest.mark.parametrize(("budget", "rows"), [(64, 16), (4, 5)])
def test_chain_steps_go_to_v2s_rejection_sampler(monkeypatch, budget, rows):
    """A step the runner published no trees for (a chain step) is V2's own
    rejection sampling, its rows as wide as a tree walk's: a chain or a
    path accepts at most ``min(B, max_depth)`` drafts, then the bonus."""
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

    from vllm_ddtree.v1.worker.gpu.spec_decode.ddtree.rejection_sampler import (
        TreeWalkSampler,
    )

    calls = []

    def v2_rejection_sampling(self, logits, input_batch, draft_logits=None):
        calls.append((self.num_speculative_steps, logits, input_batch, draft_logits))
        return "V2's output"

    monkeypatch.setattr(RejectionSampler, "__call__", v2_rejection_sampling)
    spec = SimpleNamespace(
        num_speculative_tokens=budget, rejection_sample_method="standard"
    )
    sampler = TreeWalkSampler(None, spec, torch.device("cpu"), max_depth=15)
    assert sampler.num_columns == rows
    assert sampler(logits="logits", input_batch="batch") == "V2's output"
    assert calls == [(rows - 1, "logits", "batch", None)]
    assert sampler.last_walk is None
