# SPDX-License-Identifier: Apache-2.0
"""The math of the planned per-node-state-free tree verify (docs/hybrid.md,
"Next: no per-node states"), checked in float64 before any kernel relies on it.

For one request and one head, with ``S0`` the committed ``[V, K]`` state:

* ``G_i``: summed log decay from the root to node ``i`` (inclusive);
* ``M``: ancestor-or-self mask, ``A[i, j] = beta_i exp(G_i - G_j) k_i.k_j``
  for ``j`` a proper ancestor of ``i``;
* deltas ``U = (I + A)^-1 (beta (V - exp(G) K S0^T))``, where the inverse is
  ``(I - A)(I + A^2)(I + A^4)(I + A^8)`` for trees of depth <= 15;
* outputs ``O = exp(G) Q S0^T + (M o exp(G_i - G_j) o Q K^T) U``;
* the state after node ``i``: ``exp(G_i) S0 + sum_{j <= i} exp(G_i - G_j)
  u_j k_j^T`` (``j`` over ``i``'s path).

Each is compared with the sequential gated delta rule run node by node from
the parent's state (what ``tree_gdn.tree_gated_delta_rule`` computes).
"""

from __future__ import annotations

import pytest
import torch

from tests.test_tree_gdn_ops import root_path

MAX_DEPTH = 15  # DFlash drafts 15 positions below the root


def _tree(n: int, kind: str, gen: torch.Generator) -> list[int]:
    """Parents in topological order with depth <= MAX_DEPTH (``chain``:
    depth ``n - 1``, uncapped, for the bound's own test)."""
    parents, depth = [-1], [0]
    for i in range(1, n):
        if kind == "chain":
            p = i - 1
        else:
            allowed = [j for j in range(i) if depth[j] < MAX_DEPTH]
            p = allowed[int(torch.randint(len(allowed), (1,), generator=gen))]
            if kind == "deep" and depth[i - 1] < MAX_DEPTH:
                p = i - 1 if torch.rand((), generator=gen) < 0.7 else p
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents


def _inputs(n: int, dk: int, dv: int, gen: torch.Generator):
    """Normalised keys and (scaled) queries, values, log decays, betas, S0."""
    k = torch.randn(n, dk, generator=gen, dtype=torch.float64)
    q = torch.randn(n, dk, generator=gen, dtype=torch.float64)
    k = k / k.norm(dim=-1, keepdim=True)
    q = q / q.norm(dim=-1, keepdim=True) * dk**-0.5
    v = torch.randn(n, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(n, generator=gen, dtype=torch.float64) * 0.5
    beta = torch.rand(n, generator=gen, dtype=torch.float64)
    s0 = torch.randn(dv, dk, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, s0


def _sequential(parents, q, k, v, g, beta, s0):
    """Node by node from the parent's state: outputs ``[n, V]``, states."""
    states, outs = [], []
    for i, p in enumerate(parents):
        h = (s0 if p < 0 else states[p]) * g[i].exp()
        u = (v[i] - h @ k[i]) * beta[i]
        h = h + torch.outer(u, k[i])
        states.append(h)
        outs.append(h @ q[i])
    return torch.stack(outs), states


def _ancestor_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        mask[i, root_path(parents, i)] = True
    return mask


def _nilpotent_inverse(a: torch.Tensor) -> torch.Tensor:
    """``(I - A)(I + A^2)(I + A^4)(I + A^8)``: ``sum_{m < 16} (-A)^m``."""
    eye = torch.eye(a.shape[0], dtype=a.dtype)
    inv, power = eye - a, a
    for _ in range(3):
        power = power @ power
        inv = inv @ (eye + power)
    return inv


def _parallel(parents, q, k, v, g, beta, s0):
    """The parallel form: outputs, deltas ``U``, summed log decays ``G``."""
    mask = _ancestor_mask(parents)
    big_g = (mask.double() * g[None, :]).sum(1)
    diff = torch.where(mask, big_g[:, None] - big_g[None, :], float("-inf"))
    decay = diff.exp()  # 0 off the ancestor-or-self mask
    strict = mask & ~torch.eye(len(parents), dtype=torch.bool)
    a = torch.where(strict, beta[:, None] * decay * (k @ k.T), 0.0)
    rhs = beta[:, None] * (v - big_g.exp()[:, None] * (k @ s0.T))
    u = _nilpotent_inverse(a) @ rhs
    out = big_g.exp()[:, None] * (q @ s0.T) + (decay * (q @ k.T)) @ u
    return out, u, big_g, a


def _state_at(node: int, parents, k, u, big_g, s0):
    """The state after ``node``, rebuilt from S0 and its path's ``u``, ``k``."""
    h = big_g[node].exp() * s0
    for j in root_path(parents, node):
        h = h + (big_g[node] - big_g[j]).exp() * torch.outer(u[j], k[j])
    return h


@pytest.mark.parametrize("kind", ["random", "deep", "star"])
@pytest.mark.parametrize("n", [1, 17, 65, 129])
def test_parallel_form_matches_the_sequential_rule(kind, n):
    gen = torch.Generator().manual_seed(n * 7 + len(kind))
    parents = _tree(n, kind if kind != "star" else "random", gen)
    if kind == "star":
        parents = [-1] + [0] * (n - 1)
    inputs = _inputs(n, 32, 16, gen)
    q, k, v, g, beta, s0 = inputs
    want_out, want_states = _sequential(parents, *inputs)
    out, u, big_g, _ = _parallel(parents, *inputs)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    for node in range(n):
        torch.testing.assert_close(
            _state_at(node, parents, k, u, big_g, s0),
            want_states[node],
            rtol=1e-10,
            atol=1e-10,
        )


def test_nilpotent_inverse_is_exact_to_depth_15_and_not_beyond():
    # One key for every node, no decay, beta = 1: every proper-ancestor entry
    # of A is 1, so a missing power of A shows (with random inputs A^16 is
    # ~1e-17 and a too-short product would pass unnoticed).
    gen = torch.Generator().manual_seed(0)
    for depth, exact in ((MAX_DEPTH, True), (MAX_DEPTH + 1, False)):
        n = depth + 1
        q, k, v, g, beta, s0 = _inputs(n, 8, 4, gen)
        k = k[:1].expand(n, -1)
        *_, a = _parallel(_tree(n, "chain", gen), q, k, v, 0 * g, 1 + 0 * beta, s0)
        want = torch.linalg.inv(torch.eye(n, dtype=a.dtype) + a)
        err = (_nilpotent_inverse(a) - want).abs().max().item()
        assert (err < 1e-9) == exact, (depth, err)
