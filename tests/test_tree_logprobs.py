# SPDX-License-Identifier: Apache-2.0
"""The tree sampler's output logprobs, per ``logprobs_mode`` (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID
from vllm.v1.sample.sampler import Sampler

from vllm_ddtree.v1.sample.tree_rejection_sampler import (
    TreeRejectionSampler,
    VerifyRows,
)
from vllm_ddtree.v1.spec_decode.tree import WalkResult

VOCAB = 10
NUM_DRAFT = np.array([3, 1])  # request 0: root + 3 nodes; request 1: root + 1
TEMPERATURE = [0.5, 0.0]  # request 1 greedy
TOP_K = [3, VOCAB]


@pytest.mark.parametrize(
    "mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
)
def test_output_logprobs_follow_the_accepted_path(mode):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(int((NUM_DRAFT + 1).sum()), VOCAB, generator=gen)
    rows = VerifyRows.from_device(
        [torch.from_numpy(a) for a in VerifyRows.host_arrays(NUM_DRAFT)]
    )
    # Request 0 accepted nodes 2 then 3 (not node 1), request 1 nothing.
    walk = WalkResult(
        path=torch.tensor([[0, 2, 3, -1], [0, -1, -1, -1]]),
        num_accepted=torch.tensor([2, 0]),
        bonus=torch.tensor([7, 4]),
    )
    p = PLACEHOLDER_TOKEN_ID
    out = torch.tensor([[5, 6, 7, p], [4, p, p, p]], dtype=torch.int32)
    metadata = SimpleNamespace(
        all_greedy=False,
        temperature=torch.tensor(TEMPERATURE),
        top_k=torch.tensor(TOP_K),
        top_p=None,
        max_num_logprobs=2,
    )
    sampler = TreeRejectionSampler(Sampler(logprobs_mode=mode))
    got = sampler._output_logprobs(logits, rows, walk, out, metadata)

    def expected(req: int, node: int) -> torch.Tensor:
        row = logits[int(rows.logit_rows[req, node])].clone()
        if mode.startswith("processed"):
            row = row / (TEMPERATURE[req] or 1.0)
            row[row < torch.topk(row, TOP_K[req]).values[-1]] = -float("inf")
        return row if mode.endswith("logits") else row.log_softmax(-1)

    for req, nodes in enumerate(([0, 2, 3], [0])):
        for col, node in enumerate(nodes):
            i = req * out.shape[1] + col
            want = expected(req, node)
            token = int(out[req, col])
            assert got.selected_token_ranks[i] == int((want >= want[token]).sum())
            torch.testing.assert_close(got.logprobs[i, 0], want[token])
            torch.testing.assert_close(got.logprobs[i, 1:], want.topk(2).values)
