# SPDX-License-Identifier: Apache-2.0
"""The start-up warm-up of the tree GDN ops (``warm_up_tree_gdn``).

On a GPU the warm-up makes Triton compile the two tree GDN kernels before
serving. Here it runs on layers laid out as vLLM's CUDA GDN layers are (conv
cache in the platform's layout, recurrent cache ``[slots, HV, V, K]``, vLLM's
own ``rearrange_mixed_qkv``), with the torch ops in process and with the
Triton kernels under the interpreter: it must run, and touch no state slot
but vLLM's null block (0).
"""

from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace
from unittest import mock

import torch

from tests.utils import (
    ddtree_kernels_compiled,
    interpreted_case,
    interpreter_fixture,
    run_case,
)

BUDGET = 5
WIDTH, SLOTS = 4, 7
HEADS, HEAD_K, V_HEADS, HEAD_V = 2, 16, 4, 8


def _layer(seed: int) -> SimpleNamespace:
    """A GDN layer with random caches and weights (bf16 projections)."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    gen = torch.Generator().manual_seed(seed)
    key_dim, value_dim = HEADS * HEAD_K, V_HEADS * HEAD_V
    dim = 2 * key_dim + value_dim
    cols = WIDTH - 1 + BUDGET
    conv_shape = (SLOTS, dim, cols) if is_conv_state_dim_first() else (SLOTS, cols, dim)
    layer = SimpleNamespace(
        kv_cache=[
            torch.randn(conv_shape, generator=gen).to(torch.bfloat16),
            torch.randn(SLOTS, V_HEADS, HEAD_V, HEAD_K, generator=gen),
        ],
        conv1d=SimpleNamespace(
            weight=torch.randn(dim, 1, WIDTH, generator=gen).to(torch.bfloat16),
            bias=None,
        ),
        activation="silu",
        A_log=torch.randn(V_HEADS, generator=gen),
        dt_bias=torch.randn(V_HEADS, generator=gen),
        key_dim=key_dim,
        value_dim=value_dim,
        tp_size=1,
        head_k_dim=HEAD_K,
        head_v_dim=HEAD_V,
    )
    layer.rearrange_mixed_qkv = lambda qkv: (
        QwenGatedDeltaNetAttention.rearrange_mixed_qkv(layer, qkv)
    )
    return layer


def warm_up_case(triton_ops: bool) -> dict:
    """Warm two layers up; per cache, whether slots 1.. kept their contents
    and whether slot 0 changed."""
    from vllm_ddtree.v1.attention.backends import tree_gdn_attn

    layers = [_layer(1), _layer(2)]
    before = [[t.clone() for t in layer.kv_cache] for layer in layers]
    ops = (
        mock.patch.object(tree_gdn_attn, "_tree_ops", lambda device: _triton_ops())
        if triton_ops
        else contextlib.nullcontext()
    )
    with ops:
        tree_gdn_attn.warm_up_tree_gdn(layers, 1 + BUDGET)
    pairs = [
        (new, old)
        for layer, olds in zip(layers, before, strict=True)
        for new, old in zip(layer.kv_cache, olds, strict=True)
    ]
    return {
        "kept": [torch.equal(new[1:], old[1:]) for new, old in pairs],
        # The ops ran: they rewrote the null slot of every cache.
        "ran": [not torch.equal(new[0], old[0]) for new, old in pairs],
    }


def _triton_ops():
    from vllm_ddtree.v1.ops import triton_tree_gdn

    return triton_tree_gdn


def check_warm_up(rec: dict) -> None:
    assert all(rec["kept"]) and all(rec["ran"]), rec


def test_warm_up_with_torch_ops_touches_only_the_null_slot():
    check_warm_up(warm_up_case(triton_ops=False))


def _worker() -> None:
    run_case("triton", lambda: warm_up_case(triton_ops=True))


interp_results = interpreter_fixture(__file__, timeout=300)


def test_warm_up_with_triton_kernels_interpreted(interp_results):
    check_warm_up(interpreted_case(interp_results, "triton"))


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()


def test_gpu_tests_see_our_kernels_compile_mid_serving():
    """The GPU engine tests assert that none of this package's kernels
    compiles after warm-up; the recorder must see what vLLM's JIT monitor
    reports, and only the kernels DDTree warms up (ours, and vLLM's DFlash
    input preparation)."""
    from vllm.utils import jit_monitor

    signature = {f"arg{i}": ("*i32", "D") for i in range(20)} | {"n": ("i32", "")}
    info = {"compile": {"constants": {(0,): 64}, "signature": signature}}
    with ddtree_kernels_compiled() as compiled:
        jit_monitor._log_triton_jit_compile("_tree_recurrent_kernel", info)
        jit_monitor._log_triton_jit_compile("fused_moe_kernel", info)
        jit_monitor._log_triton_jit_compile("copy_and_expand_dflash_inputs_kernel", {})
    assert [entry.split(" (")[0] for entry in compiled] == [
        "_tree_recurrent_kernel",
        "copy_and_expand_dflash_inputs_kernel",
    ]
    # Each names the variant: its constexprs and whole signature.
    assert f"{{(0,)=64}}; signature={signature!r}" in compiled[0]
