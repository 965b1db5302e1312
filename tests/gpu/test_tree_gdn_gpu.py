# SPDX-License-Identifier: Apache-2.0
"""Tree GDN kernels on a CUDA GPU: Triton vs torch, and vs vLLM's own FLA
kernels run along every root-to-leaf path.

Run on the device machine: ``python -m pytest tests/gpu/test_tree_gdn_gpu.py -q``.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_tree_gdn_ops import (
    leaf_paths,
    make_gdn_batch,
    path_errors,
    run_tree_ops,
)
from tests.test_triton_gdn_commit import CASES as COMMIT_CASES
from tests.test_triton_gdn_commit import check_commit_case, commit_case
from vllm_ddtree.v1.ops import tree_gdn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SIZES = [[1], [64], [5, 17, 33, 1], [64, 63, 9, 2, 40], [16] * 32, [130, 7]]
SHAPES = {  # (dim is derived: 2 * H * K + HV * V)
    "tiny": dict(heads=(2, 4), head_dims=(16, 32)),
    "qwen35_9b": dict(heads=(16, 32), head_dims=(128, 128)),
}


def _batch(sizes, shape, dtype, seed):
    h, hv = SHAPES[shape]["heads"]
    dk, dv = SHAPES[shape]["head_dims"]
    return make_gdn_batch(
        sizes,
        seed=seed,
        dim=2 * h * dk + hv * dv,
        heads=(h, hv),
        head_dims=(dk, dv),
        dtype=dtype,
        device="cuda",
    )


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("sizes", SIZES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_matches_chain_reference_and_torch(sizes, shape, dtype):
    from vllm_ddtree.v1.ops import triton_tree_gdn

    batch = _batch(sizes, shape, dtype, seed=len(sizes))
    conv0, ssm0 = batch.clone_states()
    conv_out, out = run_tree_ops(
        batch,
        triton_tree_gdn.tree_causal_conv1d_update,
        triton_tree_gdn.tree_gated_delta_rule,
    )
    errs = path_errors(batch, conv0, ssm0, conv_out, out)
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    assert max(errs.values()) < tol, errs

    conv_t, ssm_t = batch.conv_state.clone(), batch.ssm_state.clone()
    batch.conv_state, batch.ssm_state = conv0.clone(), ssm0.clone()
    ref_conv, ref_out = run_tree_ops(
        batch, tree_gdn.tree_causal_conv1d_update, tree_gdn.tree_gated_delta_rule
    )
    torch.testing.assert_close(conv_out.float(), ref_conv.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(ssm_t, batch.ssm_state, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(conv_t, batch.conv_state)


@pytest.mark.parametrize("sizes", [[9, 20, 1], [64]], ids=str)
def test_triton_matches_vllm_fla_kernels_along_paths(sizes):
    """vLLM's chain kernels with ``num_accepted_tokens = 1`` along each path
    give the same outputs, per-node states and conv buffer prefix."""
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update
    from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (
        fused_sigmoid_gating_delta_rule_update,
    )

    from vllm_ddtree.v1.ops import triton_tree_gdn

    batch = _batch(sizes, "tiny", torch.bfloat16, seed=3)
    conv0, ssm0 = batch.clone_states()
    conv_out, out = run_tree_ops(
        batch,
        triton_tree_gdn.tree_causal_conv1d_update,
        triton_tree_gdn.tree_gated_delta_rule,
    )
    one = torch.ones(1, dtype=torch.int32, device="cuda")
    qsl = batch.query_start_loc.tolist()
    for r, parents in enumerate(batch.parents):
        for path in leaf_paths(parents):
            t = torch.tensor([qsl[r] + i for i in path], device="cuda")
            n = len(path)
            cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
            conv = conv0.clone()
            ref_conv = causal_conv1d_update(
                batch.x[t], conv, batch.conv_weight, batch.conv_bias, "silu",
                conv_state_indices=batch.conv_slots[r : r + 1],
                num_accepted_tokens=one, query_start_loc=cu, max_query_len=n,
                validate_data=False,
            )  # fmt: skip
            torch.testing.assert_close(conv_out[t], ref_conv, atol=2e-2, rtol=2e-2)
            ssm = ssm0.clone()
            slots = batch.state_indices[r, torch.tensor(path, device="cuda")]
            ref_out, _ = fused_sigmoid_gating_delta_rule_update(
                A_log=batch.A_log, a=batch.a[t], b=batch.b[t], dt_bias=batch.dt_bias,
                q=batch.q[t][None], k=batch.k[t][None], v=batch.v[t][None],
                initial_state=ssm, inplace_final_state=True, cu_seqlens=cu,
                ssm_state_indices=slots[None].int(), num_accepted_tokens=one,
                use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
            torch.testing.assert_close(
                out[t], ref_out.view_as(out[t]), atol=2e-2, rtol=2e-2
            )
            for s in slots.tolist():
                torch.testing.assert_close(
                    batch.ssm_state[s], ssm[s], atol=1e-5, rtol=1e-5
                )


@pytest.mark.parametrize("name", list(COMMIT_CASES))
def test_all_layers_commit_matches_torch(name):
    """The compiled two-launch commit (the CPU suite runs it interpreted)."""
    check_commit_case(commit_case(name, "cuda"))
