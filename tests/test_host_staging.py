# SPDX-License-Identifier: Apache-2.0
"""HostStaging: a step's index arrays in one transfer, values and shapes
kept, results independent of the reused staging buffer (CPU; the GPU path is
the same code with a pinned buffer and a non-blocking copy)."""

from __future__ import annotations

import numpy as np
import torch

from vllm_ddtree.v1.sample.tree_rejection_sampler import VerifyRows
from vllm_ddtree.v1.worker.host_staging import HostStaging


def test_upload_keeps_values_shapes_and_grows():
    staging = HostStaging("cpu")
    a = np.arange(6).reshape(2, 3)
    b = np.array([True, False, True])
    c = np.array([], dtype=np.int64)
    ta, tb, tc = staging.upload(a, b, c)
    assert ta.dtype == torch.int64 and ta.shape == (2, 3)
    assert torch.equal(ta, torch.from_numpy(a))
    assert tb.tolist() == [1, 0, 1] and tc.numel() == 0
    big = np.arange(5000)
    (tbig,) = staging.upload(big)  # past the first buffer: it grows
    assert torch.equal(tbig, torch.from_numpy(big))
    # Earlier results are not views of the (rewritten) staging buffer.
    assert torch.equal(ta, torch.from_numpy(a))


def test_every_array_starts_on_16_bytes():
    """As a fresh tensor would (Triton specialises kernels on it)."""
    arrays = [np.arange(n) for n in (1, 3, 0, 2, 5, 1)]
    tensors = HostStaging("cpu").upload(*arrays)
    assert [t.data_ptr() % 16 for t in tensors] == [0] * len(arrays)
    for array, tensor in zip(arrays, tensors, strict=True):
        assert tensor.tolist() == array.tolist()


def test_verify_rows_maps():
    """Logit rows / draft rows of requests with 2, 0 and 1 drafts."""
    num_draft = np.array([2, 0, 1])
    arrays = VerifyRows.host_arrays(num_draft)
    rows = VerifyRows.from_device(HostStaging("cpu").upload(*arrays))
    assert rows.num_nodes.tolist() == [3, 1, 2]
    assert rows.logit_rows.tolist() == [[0, 1, 2], [3, 0, 0], [4, 5, 0]]
    assert rows.is_draft.tolist() == [
        [False, True, True],
        [False, False, False],
        [False, True, False],
    ]
    assert rows.draft_rows[rows.is_draft].tolist() == [0, 1, 2]
    assert rows.node_req.tolist() == [0, 0, 0, 1, 2, 2]
