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


def test_uploads_take_the_buffers_in_turn():
    """Each upload fills the next of the staging buffers (on a GPU the copy
    that last read it was made ``slots`` uploads ago), growing it when it is
    too small; every upload's values come through."""
    staging = HostStaging("cpu", slots=3)
    sizes = [5, 2000, 7, 3, 4000, 1, 9]
    for n in sizes:
        (t,) = staging.upload(np.arange(n) * 3)
        assert t.tolist() == list(range(0, 3 * n, 3))
    # Uploads 0, 3, 6 used buffer 0; 1 and 4 buffer 1 (grown for 4000).
    assert [b.numel() for b in staging._host] == [1024, 4000, 1024]


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


def test_layout_stager_reuses_a_repeated_layout():
    """A layout staged again (steady decoding) is the one staged before,
    without a second upload; other counts, offsets or extra arrays are new
    layouts; the oldest goes past the capacity."""
    from vllm_ddtree.v1.worker.verify_plan import LayoutStager

    stager = LayoutStager("cpu", capacity=2)
    uploads = []
    upload = stager.staging.upload
    stager.staging.upload = lambda *arrays: uploads.append(1) or upload(*arrays)
    nodes, ends = np.array([3, 1]), np.array([3, 5])
    first = stager(nodes, ends)
    assert stager(nodes.copy(), ends.copy()) is first and len(uploads) == 1
    assert first.num_nodes.tolist() == [3, 1] and first.total == 5
    others = [
        stager(np.array([2, 1]), np.array([2, 4])),  # other counts
        stager(nodes, np.array([3, 6])),  # other offsets
        stager(nodes, ends, extra=(np.array([0, -1]),)),  # other extra array
    ]
    assert len(uploads) == 4 and all(o is not first for o in others)
    assert stager(nodes, ends) is not first  # evicted (capacity 2)
    assert len(uploads) == 5


def test_aligned_planes_start_on_16_bytes():
    """Planes of odd sizes (an odd R * B) each start where a fresh tensor
    would, for every dtype the kernels take one pointer per plane of."""
    from vllm_ddtree.v1.ops.triton_tree_cores import aligned_planes

    for dtype in (torch.int32, torch.int64, torch.float32):
        planes = aligned_planes(3, (3, 5), dtype, "cpu")
        assert planes.shape == (3, 3, 5) and planes[1].stride() == (5, 1)
        assert [p.data_ptr() % 16 for p in planes] == [0, 0, 0]
