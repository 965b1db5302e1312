# SPDX-License-Identifier: Apache-2.0
"""Per-step tree budgets from a latency model of the target.

A wider tree accepts more tokens per step but makes the verify forward
longer; how much longer depends on the batch (at batch 1 a 64-node tree costs
about what a 16-token chain costs, at batch 64 it does not). So instead of a
fixed ``B`` per request, each step picks the set of nodes that maximises the
expected decoding rate::

    rate(S) = (R + sum_{n in S} p_n) / step_time(R + |S|)

* ``R`` requests each produce one token (the bonus) whatever happens.
* ``p_n`` is the probability that node ``n`` ends up on the accepted path.
  Under the drafter's own distribution that is the product of the draft
  probabilities along the node's path, i.e. ``exp(score)`` of
  :class:`~vllm_ddtree.v1.spec_decode.tree.DraftTrees`; the expected
  acceptance length of a tree is the sum over its nodes.
* ``step_time(T)`` is measured at startup for a grid of token counts
  (:class:`LatencyModel`) and interpolated.

For a fixed node count the best set is the ``|S|`` most probable nodes over
all requests. A child is never more probable than its parent and every tree
lists its nodes best-first, so that set is a prefix of each request's tree:
the choice reduces to one threshold, found by scanning all prefix sizes.

On a GPU one more candidate competes: every request verifies its whole
tree. Such a *uniform* batch replays as one full CUDA graph, any cut batch
runs with piecewise graphs (attention eager between the pieces), so the two
have different latency curves; the full-graph one is measured separately,
per uniform batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LatencyModel:
    """Measured forward time (seconds) at increasing token counts.

    Linear interpolation between points; constant below the first point and
    linear extrapolation (from the last two points) above the last one.
    """

    num_tokens: np.ndarray
    seconds: np.ndarray

    def __post_init__(self) -> None:
        if len(self.num_tokens) < 2 or np.any(np.diff(self.num_tokens) <= 0):
            raise ValueError("a latency model needs >= 2 increasing token counts")

    def __call__(self, num_tokens: np.ndarray) -> np.ndarray:
        x = np.asarray(num_tokens, dtype=np.float64)
        t, s = self.num_tokens.astype(np.float64), self.seconds.astype(np.float64)
        inside = np.interp(x, t, s)
        slope = max((s[-1] - s[-2]) / (t[-1] - t[-2]), 0.0)
        return np.where(x > t[-1], s[-1] + (x - t[-1]) * slope, inside)


def choose_budgets(
    scores: np.ndarray,
    caps: np.ndarray,
    latency: LatencyModel,
    full_graph: LatencyModel | None = None,
) -> np.ndarray:
    """Nodes to verify per request, maximising expected tokens per second.

    Args:
        scores: ``[R, B]`` path log-probabilities of each request's tree
            nodes, best-first (non-increasing along each row).
        caps: ``[R]`` most nodes a request may take (its own budget).
        latency: step time as a function of the batch's total token count.
        full_graph: step time of a uniform batch (every request verifying
            all ``B`` nodes) as a function of its token count, where such
            batches replay as full CUDA graphs; considered only when every
            cap is ``B``.

    Returns:
        ``[R]`` int array, ``0 <= k_r <= caps[r]``: verify each request's
        first ``k_r`` nodes.
    """
    num_reqs, width = scores.shape
    prob = np.exp(scores.astype(np.float64))
    usable = np.arange(width)[None, :] < np.asarray(caps)[:, None]
    prob = np.where(usable, prob, -1.0)
    # All usable nodes, most probable first; ties keep each row's order so a
    # cut never takes a child without its parent.
    flat = prob.ravel()
    order = np.lexsort((np.arange(flat.size), -flat))
    order = order[flat[order] >= 0.0]
    expected = num_reqs + np.concatenate([[0.0], np.cumsum(flat[order])])
    total = num_reqs + np.arange(len(order) + 1)
    rates = expected / latency(total)
    best = int(np.argmax(rates))
    if full_graph is not None and np.all(np.asarray(caps) == width):
        full_rate = expected[-1] / float(full_graph(num_reqs * (1 + width)))
        if full_rate > rates[best]:
            return np.asarray(caps, dtype=np.int64).copy()
    budgets = np.zeros(num_reqs, dtype=np.int64)
    np.add.at(budgets, order[:best] // width, 1)
    return budgets
