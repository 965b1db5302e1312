# SPDX-License-Identifier: Apache-2.0
"""Per-request DDTree statistics, measured in the front-end process.

vLLM's spec-decode counters are engine-wide (logs, Prometheus). Per request,
vLLM keeps only a ``RequestStateStats`` (token count and timestamps) in the
front-end, exposed as ``RequestOutput.metrics`` and, with
``--enable-per-request-metrics``, as the ``metrics`` object of OpenAI
responses. The plugin extends that path:

1. the input processor resolves each request's DDTree settings (its tree
   budget after the ``ddtree_budget`` override, the deepest possible round)
   into its own copy of the sampling params (:func:`stamp_settings`);
2. the output processor attaches a :class:`DDTreeRequestStats` to the
   request's ``RequestStateStats`` (:func:`attach`);
3. every engine output that brings the request new tokens after its first
   one is one tree-verification round (:func:`observe`): a round commits the
   accepted path plus the bonus token, so tokens per round is the request's
   mean acceptance length, the same quantity vLLM logs engine-wide.

The counts are of tokens *delivered*: the last round of a request that hits
``max_tokens`` or a stop token is truncated, and a preempted request's first
round after recomputation delivers one token, both of which pull the mean
slightly down.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_ddtree.config import BUDGET_ARG, DDTreeConfig

# Key of ``SamplingParams.extra_args`` carrying the resolved settings; set by
# the front-end on its own copy of the params, not a user option.
SETTINGS_ARG = "_ddtree_settings"
# Attribute of vLLM's ``RequestStateStats`` holding the DDTree stats.
_STATS_ATTR = "ddtree"


@dataclass
class DDTreeRequestStats:
    """DDTree statistics of one sequence.

    Attributes:
        block_size: most tokens one round can commit (deepest path plus the
            bonus token): ``max_depth + 1``.
        tree_budget: tree nodes verified per round for this request (the
            engine's budget, or the request's ``ddtree_budget``).
        decode_rounds: tree-verification rounds (engine steps after the first
            token that brought this request new tokens).
        round_tokens: tokens those rounds delivered.
    """

    block_size: int
    tree_budget: int
    decode_rounds: int = 0
    round_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per round (accepted drafts + bonus); None before a round."""
        if not self.decode_rounds:
            return None
        return self.round_tokens / self.decode_rounds

    def to_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "tree_budget": self.tree_budget,
            "decode_rounds": self.decode_rounds,
            "mean_acceptance_length": self.mean_acceptance_length,
        }


def stamp_settings(params: Any, cfg: DDTreeConfig) -> None:
    """Record ``cfg`` as resolved for this request in ``params.extra_args``.

    ``params`` must be the engine's own copy of the request's params (the
    input processor clones them): a fresh dict is assigned, so the caller's
    ``extra_args`` are never modified.
    """
    extra = dict(params.extra_args or {})
    budget = extra.get(BUDGET_ARG)
    extra[SETTINGS_ARG] = {
        "block_size": cfg.max_depth + 1,
        "tree_budget": cfg.budget if budget is None else budget,
    }
    params.extra_args = extra


def attach(req_stats: Any, params: Any) -> None:
    """Start DDTree stats on vLLM's per-request stats if ``params`` were
    stamped by a DDTree engine."""
    settings = (getattr(params, "extra_args", None) or {}).get(SETTINGS_ARG)
    if req_stats is not None and settings is not None:
        setattr(req_stats, _STATS_ATTR, DDTreeRequestStats(**settings))


def observe(req_stats: Any, num_new_tokens: int, is_prefilling: bool) -> None:
    """Count one engine output of a request (see the module docstring)."""
    stats = get_stats(req_stats)
    if stats is not None and num_new_tokens and not is_prefilling:
        stats.decode_rounds += 1
        stats.round_tokens += num_new_tokens


def get_stats(req_stats: Any) -> DDTreeRequestStats | None:
    """The DDTree stats kept on a ``RequestStateStats``, if any."""
    return getattr(req_stats, _STATS_ATTR, None)


def request_stats(output: Any) -> DDTreeRequestStats | None:
    """DDTree statistics of a finished ``RequestOutput``.

    Needs engine statistics on (``LLM(..., disable_log_stats=False)``; the
    server has them on by default). For ``n > 1`` vLLM's ``RequestOutput``
    carries the stats of one of the sequences only.
    """
    return get_stats(getattr(output, "metrics", None))
