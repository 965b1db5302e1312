# SPDX-License-Identifier: Apache-2.0
"""Tree Gated DeltaNet state ops: every root-to-leaf path equals the chain.

For random batches of trees (1..64 nodes, random parents in topological
order, requests with random cache slots) the tree ops run once; then, for
every root-to-leaf path, the chain reference runs token by token along that
path from the same committed state, and each node's output and state must
match. References: a float64 loop written here, and vLLM's own CPU ops
(``causal_conv1d_update_torch`` and the C++ chain recurrence) along each
path. The Triton kernels are checked the same way under ``TRITON_INTERPRET=1``
(one subprocess, like ``test_triton_tree_attention.py``). The batch builders
are shared with ``tests/gpu/test_tree_gdn_gpu.py``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from tests.utils import interpreted_case, interpreter_fixture, run_case
from vllm_ddtree.v1.ops.tree_gdn import (
    commit_tree_state,
    tree_causal_conv1d_update,
    tree_gated_delta_rule,
)

# ---------------------------------------------------------------------------
# random tree batches (shared with the GPU tests)
# ---------------------------------------------------------------------------


def random_parents(n: int, gen: torch.Generator, kind: str = "random") -> list[int]:
    """Parents in topological order: ``parent[0] = -1``, ``parent[i] < i``."""
    parents = [-1]
    for i in range(1, n):
        if kind == "chain":
            parents.append(i - 1)
        elif kind == "star":
            parents.append(0)
        elif kind == "deep":  # mostly the previous node, sometimes a jump
            jump = torch.rand((), generator=gen) < 0.3
            parents.append(
                int(torch.randint(0, i, (1,), generator=gen)) if jump else i - 1
            )
        else:
            parents.append(int(torch.randint(0, i, (1,), generator=gen)))
    return parents


def leaf_paths(parents: list[int]) -> list[list[int]]:
    """Every root-to-leaf path (node indices, root first)."""
    has_child = {p for p in parents if p >= 0}
    paths = []
    for leaf in range(len(parents)):
        if leaf in has_child:
            continue
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        paths.append(path[::-1])
    return paths


@dataclass
class GDNBatch:
    """Inputs of one tree step for ``R`` requests (all on one device)."""

    sizes: list[int]
    parents: list[list[int]]
    query_start_loc: torch.Tensor
    flat_parents: torch.Tensor
    x: torch.Tensor  # [T, dim] conv input
    conv_state: torch.Tensor  # [slots, dim, state_len]
    conv_weight: torch.Tensor  # [dim, W]
    conv_bias: torch.Tensor
    conv_slots: torch.Tensor  # [R]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    ssm_state: torch.Tensor  # [slots, HV, V, K]
    state_indices: torch.Tensor  # [R, 1 + num_spec]

    def clone_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv_state.clone(), self.ssm_state.clone()


def make_gdn_batch(
    sizes: list[int],
    *,
    seed: int = 0,
    dim: int = 48,
    width: int = 4,
    heads: tuple[int, int] = (2, 4),
    head_dims: tuple[int, int] = (16, 32),
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    kinds: tuple[str, ...] = ("random", "deep", "chain", "star"),
    spare_slots: int = 3,
) -> GDNBatch:
    gen = torch.Generator().manual_seed(seed)
    num_spec = max(sizes) - 1 + int(torch.randint(0, 3, (1,), generator=gen))
    parents = [
        random_parents(n, gen, kinds[i % len(kinds)]) for i, n in enumerate(sizes)
    ]
    num_tokens = sum(sizes)
    h, hv = heads
    dk, dv = head_dims
    # Slot 0 is vLLM's null block (its FLA kernels skip it), so no request
    # gets it: the state tensors have one row more than the slots handed out.
    num_slots = len(sizes) * (num_spec + 1) + spare_slots + 1
    perm = torch.randperm(num_slots - 1, generator=gen) + 1
    state_indices = perm[: len(sizes) * (num_spec + 1)].view(len(sizes), num_spec + 1)
    conv_slots = torch.randperm(num_slots - 1, generator=gen)[: len(sizes)] + 1

    def rnd(*shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def dev(t: torch.Tensor, dt: torch.dtype | None = None) -> torch.Tensor:
        return t.to(device=device, dtype=dt or t.dtype)

    lengths = torch.tensor(sizes)
    qsl = torch.zeros(len(sizes) + 1, dtype=torch.int32)
    qsl[1:] = lengths.cumsum(0)
    return GDNBatch(
        sizes=sizes,
        parents=parents,
        query_start_loc=dev(qsl),
        flat_parents=dev(torch.tensor(sum(parents, []), dtype=torch.int32)),
        x=dev(rnd(num_tokens, dim), dtype),
        conv_state=dev(rnd(num_slots, dim, width - 1 + num_spec), dtype),
        conv_weight=dev(rnd(dim, width, std=0.5), dtype),
        conv_bias=dev(rnd(dim, std=0.1), dtype),
        # Strided views: the kernels must honour any index layout (the
        # engine's conv slots are column 0 of its state indices).
        conv_slots=dev(conv_slots.int().repeat_interleave(2).view(-1, 2))[:, 0],
        q=dev(rnd(num_tokens, h, dk), dtype),
        k=dev(rnd(num_tokens, h, dk), dtype),
        v=dev(rnd(num_tokens, hv, dv), dtype),
        a=dev(rnd(num_tokens, hv), dtype),
        b=dev(rnd(num_tokens, hv), dtype),
        A_log=dev(rnd(hv, std=0.5)),
        dt_bias=dev(rnd(hv, std=0.5)),
        ssm_state=dev(rnd(num_slots, hv, dv, dk, std=0.3)),
        state_indices=dev(state_indices.int().t().contiguous()).t(),
    )


# ---------------------------------------------------------------------------
# chain references
# ---------------------------------------------------------------------------


def chain_conv_reference(
    x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 causal conv + SiLU of ``x [L, dim]`` after ``history [dim, W-1]``;
    returns (outputs [L, dim], final history [dim, W-1])."""
    seq = torch.cat([history.double(), x.double().T], dim=1)
    width = weight.shape[1]
    outs = [
        (seq[:, i : i + width] * weight.double()).sum(1) + bias.double()
        for i in range(x.shape[0])
    ]
    return F.silu(torch.stack(outs)), seq[:, -(width - 1) :]


def chain_delta_rule_reference(
    q, k, v, a, b, A_log, dt_bias, state: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Float64 sequential sigmoid-gated delta rule over ``L`` tokens from
    ``state [HV, V, K]``; returns outputs ``[L, HV, V]`` and every state."""
    group = v.shape[1] // q.shape[1]
    h = state.double()
    outs, states = [], []
    for t in range(q.shape[0]):
        qt = q[t].double().repeat_interleave(group, 0)
        kt = k[t].double().repeat_interleave(group, 0)
        qt = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + 1e-6)
        kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
        qt = qt * q.shape[-1] ** -0.5
        g = -A_log.double().exp() * F.softplus(a[t].double() + dt_bias.double())
        beta = torch.sigmoid(b[t].double())
        h = h * g.exp()[:, None, None]
        delta = (v[t].double() - torch.einsum("hvk,hk->hv", h, kt)) * beta[:, None]
        h = h + delta[:, :, None] * kt[:, None, :]
        outs.append(torch.einsum("hvk,hk->hv", h, qt))
        states.append(h)
    return torch.stack(outs), states


def run_tree_ops(
    batch: GDNBatch, conv_fn, rule_fn
) -> tuple[torch.Tensor, torch.Tensor]:
    conv_out = conv_fn(
        batch.x,
        batch.conv_state,
        batch.conv_weight,
        batch.conv_bias,
        "silu",
        batch.conv_slots,
        batch.query_start_loc,
        batch.flat_parents,
    )
    out = rule_fn(
        batch.q,
        batch.k,
        batch.v,
        batch.a,
        batch.b,
        batch.A_log,
        batch.dt_bias,
        batch.ssm_state,
        batch.state_indices,
        batch.query_start_loc,
        batch.flat_parents,
    )
    return conv_out, out


def path_errors(
    batch: GDNBatch,
    conv_before: torch.Tensor,
    ssm_before: torch.Tensor,
    conv_out: torch.Tensor,
    out: torch.Tensor,
) -> dict[str, float]:
    """Max errors (see :func:`_err`) of the tree results against the float64 chain
    references along every root-to-leaf path, plus the commit of each."""
    errs = {"conv": 0.0, "out": 0.0, "state": 0.0, "commit_conv": 0.0}
    width = batch.conv_weight.shape[1]
    qsl = batch.query_start_loc.tolist()
    for r, parents in enumerate(batch.parents):
        slot = int(batch.conv_slots[r])
        history = conv_before[slot, :, : width - 1]
        state0 = ssm_before[int(batch.state_indices[r, 0])]
        for path in leaf_paths(parents):
            t = torch.tensor([qsl[r] + i for i in path], device=batch.x.device)
            ref_conv, ref_hist = chain_conv_reference(
                batch.x[t], history, batch.conv_weight, batch.conv_bias
            )
            ref_out, ref_states = chain_delta_rule_reference(
                batch.q[t], batch.k[t], batch.v[t], batch.a[t], batch.b[t],
                batch.A_log, batch.dt_bias, state0,
            )  # fmt: skip
            errs["conv"] = max(errs["conv"], _err(conv_out[t], ref_conv))
            errs["out"] = max(errs["out"], _err(out[t], ref_out))
            for node, ref_state in zip(path, ref_states, strict=True):
                got = batch.ssm_state[int(batch.state_indices[r, node])]
                errs["state"] = max(errs["state"], _err(got, ref_state))
            # Committing this path leaves its final conv history.
            conv = batch.conv_state.clone()
            commit_tree_state(
                conv, None, batch.conv_slots[r : r + 1], batch.state_indices[r : r + 1],
                torch.tensor([path], device=t.device),
                torch.tensor([len(path)], device=t.device), width,
            )  # fmt: skip
            got_hist = conv[slot, :, : width - 1]
            errs["commit_conv"] = max(errs["commit_conv"], _err(got_hist, ref_hist))
    return errs


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs error, in units of the reference's largest magnitude when
    that exceeds 1: a bf16 result is rounded relative to its size (the
    Qwen3.5-sized conv outputs reach about 8, where one bf16 step is 1/16)."""
    want = want.double().to(got.device)
    scale = max(1.0, float(want.abs().max()))
    return float((got.double() - want).abs().max()) / scale


SIZES = [[1], [2, 1, 3], [64], [5, 17, 33, 1], [64, 63, 9]]

# ---------------------------------------------------------------------------
# torch ops (in process)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", SIZES, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_torch_tree_ops_match_chains(sizes, seed):
    batch = make_gdn_batch(sizes, seed=seed)
    conv_before, ssm_before = batch.clone_states()
    conv_out, out = run_tree_ops(
        batch, tree_causal_conv1d_update, tree_gated_delta_rule
    )
    errs = path_errors(batch, conv_before, ssm_before, conv_out, out)
    assert max(errs.values()) < 1e-4, errs
    # Slots that belong to no node are untouched.
    used = set(batch.state_indices[:, : max(sizes)].flatten().tolist())
    for s in range(batch.ssm_state.shape[0]):
        if s not in used:
            assert torch.equal(batch.ssm_state[s], ssm_before[s]), s


def test_torch_conv_buffer_layout_is_vllm_chain_layout():
    """After a step the conv slot holds ``history[1:] ++ x(nodes)``."""
    batch = make_gdn_batch([7, 3], seed=5)
    before = batch.conv_state.clone()
    run_tree_ops(batch, tree_causal_conv1d_update, tree_gated_delta_rule)
    for r, n in enumerate(batch.sizes):
        slot = int(batch.conv_slots[r])
        start = int(batch.query_start_loc[r])
        want = torch.cat([before[slot, :, 1:3], batch.x[start : start + n].T], dim=1)
        torch.testing.assert_close(batch.conv_state[slot, :, : 2 + n], want)


def test_commit_then_next_step_continues_the_path():
    """Commit a path, then run a chain step: equal to one long chain."""
    batch = make_gdn_batch([12], seed=3, kinds=("random",))
    conv_before, ssm_before = batch.clone_states()
    run_tree_ops(batch, tree_causal_conv1d_update, tree_gated_delta_rule)
    path = max(leaf_paths(batch.parents[0]), key=len)
    commit_tree_state(
        batch.conv_state, batch.ssm_state, batch.conv_slots, batch.state_indices,
        torch.tensor([path]), torch.tensor([len(path)]), 4,
    )  # fmt: skip
    nxt = make_gdn_batch([5], seed=4, kinds=("chain",))
    for name in ("conv_state", "ssm_state", "conv_weight", "conv_bias",
                 "conv_slots", "state_indices", "A_log", "dt_bias"):  # fmt: skip
        setattr(nxt, name, getattr(batch, name))
    conv_out, out = run_tree_ops(nxt, tree_causal_conv1d_update, tree_gated_delta_rule)

    t = torch.tensor(path)
    cat = {n: torch.cat([getattr(batch, n)[t], getattr(nxt, n)]) for n in "xqkvab"}
    slot, s0 = int(batch.conv_slots[0]), int(batch.state_indices[0, 0])
    ref_conv, _ = chain_conv_reference(
        cat["x"], conv_before[slot, :, :3], batch.conv_weight, batch.conv_bias
    )
    ref_out, ref_states = chain_delta_rule_reference(
        cat["q"], cat["k"], cat["v"], cat["a"], cat["b"],
        batch.A_log, batch.dt_bias, ssm_before[s0],
    )  # fmt: skip
    assert _err(conv_out, ref_conv[len(path) :]) < 1e-4
    assert _err(out, ref_out[len(path) :]) < 1e-4
    last = batch.ssm_state[int(batch.state_indices[0, 4])]
    assert _err(last, ref_states[-1]) < 1e-4


def test_torch_ops_match_vllm_cpu_kernels_along_paths():
    """bf16 inputs, vLLM CPU layouts: along every path the tree ops agree with
    vLLM's CPU decode conv (torch) and its C++ chain recurrence."""
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import (
        causal_conv1d_update_torch,
    )

    batch = make_gdn_batch([9, 20], seed=7, dtype=torch.bfloat16)
    batch.A_log, batch.dt_bias = batch.A_log.bfloat16(), batch.dt_bias.bfloat16()
    conv_before, ssm_before = batch.clone_states()
    slots, hv, dv, dk = batch.ssm_state.shape
    # vLLM's CPU kernels read a state slot's memory as [K, V].
    cpu_view = batch.ssm_state.view(slots, hv, dk, dv)
    conv_out, out = run_tree_ops(
        batch,
        tree_causal_conv1d_update,
        lambda *args: tree_gated_delta_rule(
            *args[:7], cpu_view.transpose(-1, -2), *args[8:]
        ),
    )
    width = batch.conv_weight.shape[1]
    qsl = batch.query_start_loc.tolist()
    for r, parents in enumerate(batch.parents):
        for path in leaf_paths(parents):
            t = torch.tensor([qsl[r] + i for i in path])
            slot = int(batch.conv_slots[r])
            hist = conv_before[slot : slot + 1, :, : width - 1].clone()
            ref_conv = causal_conv1d_update_torch(
                batch.x[t].T[None], hist, batch.conv_weight, batch.conv_bias, "silu"
            )[0].T
            assert _err(conv_out[t], ref_conv) <= 0.02, path  # bf16 rounding
            # C++ chain recurrence on the path's own conv outputs.
            state = ssm_before.clone()
            idx = torch.zeros(1, len(path), dtype=torch.int32)
            idx[0, :] = torch.arange(len(path)) + 1
            state[1] = ssm_before[int(batch.state_indices[r, 0])]
            ref = ops.fused_sigmoid_gating_delta_rule_update_spec_cpu(
                A_log=batch.A_log, dt_bias=batch.dt_bias,
                q=batch.q[t], k=batch.k[t], v=batch.v[t], a=batch.a[t], b=batch.b[t],
                initial_state_source=state.view(slots, hv, dk, dv),
                spec_state_indices=idx,
                num_accepted_tokens=torch.ones(1, dtype=torch.int32),
                cu_seqlens=torch.tensor([0, len(path)], dtype=torch.int32),
                use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
            assert _err(out[t], ref.view(len(path), hv, dv)) <= 1e-2, path
            for j, node in enumerate(path):
                got = batch.ssm_state[int(batch.state_indices[r, node])]
                assert _err(got, state[j + 1]) < 1e-5, (path, node)


def test_commit_moves_leaf_state_to_column_zero():
    batch = make_gdn_batch([6, 1, 4], seed=2)
    run_tree_ops(batch, tree_causal_conv1d_update, tree_gated_delta_rule)
    paths = [max(leaf_paths(p), key=len) for p in batch.parents]
    padded = torch.zeros(3, 6, dtype=torch.long)
    for r, p in enumerate(paths):
        padded[r, : len(p)] = torch.tensor(p)
    leaf_states = [
        batch.ssm_state[int(batch.state_indices[r, p[-1]])].clone()
        for r, p in enumerate(paths)
    ]
    commit_tree_state(
        batch.conv_state, batch.ssm_state, batch.conv_slots, batch.state_indices,
        padded, torch.tensor([len(p) for p in paths]), 4,
    )  # fmt: skip
    for r, want in enumerate(leaf_states):
        assert torch.equal(batch.ssm_state[int(batch.state_indices[r, 0])], want)


def test_commit_elsewhere_writes_the_state_at_each_depth():
    """With ``dst_slots`` (prefix caching's block-boundary states), the
    state after the path's first ``d`` nodes lands in another slot, in the
    committed layout, and the tree's own slots stay as they are."""
    batch = make_gdn_batch([9, 5], seed=8, spare_slots=6)
    conv_before, ssm_before = batch.clone_states()
    run_tree_ops(batch, tree_causal_conv1d_update, tree_gated_delta_rule)
    used = set(batch.state_indices.flatten().tolist())
    used |= set(batch.conv_slots.tolist())
    free = [s for s in range(1, batch.ssm_state.shape[0]) if s not in used]
    width = batch.conv_weight.shape[1]
    for r, parents in enumerate(batch.parents):
        path = max(leaf_paths(parents), key=len)
        slot = int(batch.conv_slots[r])
        start = int(batch.query_start_loc[r])
        for d in range(1, len(path) + 1):
            conv, ssm = batch.conv_state.clone(), batch.ssm_state.clone()
            commit_tree_state(
                conv, ssm, batch.conv_slots[r : r + 1],
                batch.state_indices[r : r + 1], torch.tensor([path]),
                torch.tensor([d]), width, dst_slots=torch.tensor([free[0]]),
            )  # fmt: skip
            want_ssm = batch.ssm_state[int(batch.state_indices[r, path[d - 1]])]
            assert torch.equal(ssm[free[0]], want_ssm), (r, d)
            nodes = torch.tensor(path[:d]) + start
            _, want_hist = chain_conv_reference(
                batch.x[nodes], conv_before[slot, :, : width - 1],
                batch.conv_weight, batch.conv_bias,
            )  # fmt: skip
            assert _err(conv[free[0], :, : width - 1], want_hist) < 1e-6, (r, d)
            # Only the destination changed.
            conv[free[0]], ssm[free[0]] = batch.conv_state[free[0]], ssm_before[free[0]]
            assert torch.equal(conv, batch.conv_state)
            assert torch.equal(ssm, batch.ssm_state)


# ---------------------------------------------------------------------------
# Triton kernels under the interpreter (subprocess)
# ---------------------------------------------------------------------------

INTERP_CASES: dict[str, dict] = {
    "one_node": dict(sizes=[1], seed=11),
    "mixed_small": dict(sizes=[3, 1, 6], seed=12),
    "wide_and_deep": dict(sizes=[16, 9], seed=13),
    "bf16": dict(sizes=[7, 5], seed=14, dtype="bfloat16"),
    "width3_gqa1": dict(sizes=[8], seed=15, width=3, heads=(4, 4)),
    # More nodes than the conv kernel's node tile (16).
    "multi_tile": dict(sizes=[35, 2], seed=16),
}


def _worker() -> None:
    try:
        from vllm_ddtree.v1.ops import triton_tree_gdn as ttg
    except Exception as exc:  # pragma: no cover - environment dependent
        print("SKIP " + json.dumps(f"cannot import triton kernels: {exc!r}"))
        return

    def case(spec: dict) -> dict:
        spec = dict(spec)
        if "dtype" in spec:
            spec["dtype"] = getattr(torch, spec["dtype"])
        batch = make_gdn_batch(**spec)
        conv_before, ssm_before = batch.clone_states()
        conv_out, out = run_tree_ops(
            batch, ttg.tree_causal_conv1d_update, ttg.tree_gated_delta_rule
        )
        res = path_errors(batch, conv_before, ssm_before, conv_out, out)
        return res | {"tol": 2e-2 if "dtype" in spec else 1e-4}

    for name, spec in INTERP_CASES.items():
        run_case(name, lambda spec=spec: case(spec))


interp_results = interpreter_fixture(__file__, timeout=900)


@pytest.mark.parametrize("name", list(INTERP_CASES))
def test_triton_kernels_interpreted(interp_results, name):
    rec = interpreted_case(interp_results, name)
    tol = rec.pop("tol")
    rec.pop("name")
    assert max(rec.values()) < tol, rec


def test_flat_parents_concatenates_each_rows_nodes():
    """The GDN metadata's flattened parents (sized from the host counts, no
    device sync) equal the boolean-mask selection of the valid nodes."""
    from vllm_ddtree.v1.attention.backends.tree_gdn_attn import _flat_parents

    gen = torch.Generator().manual_seed(0)
    counts = [1, 7, 3, 12, 1]
    parents = torch.full((len(counts), 12), -1, dtype=torch.int64)
    for r, n in enumerate(counts):
        parents[r, :n] = torch.tensor(random_parents(n, gen, "random"))
    num_nodes = torch.tensor(counts, dtype=torch.int32)
    valid = torch.arange(12)[None, :] < num_nodes[:, None]
    got = _flat_parents(parents, num_nodes, counts)
    assert got.dtype == torch.int32
    assert got.tolist() == parents[valid].tolist()


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
