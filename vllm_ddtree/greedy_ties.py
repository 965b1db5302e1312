# SPDX-License-Identifier: Apache-2.0
"""When two greedy outputs may differ: the near-tie rule.

Greedy DDTree must give no-spec's tokens. In bf16 a token whose two best
log-probabilities tie (or nearly) is the exception: a batched tree verify and
a one-token decode sum in different orders, so the argmax may go either way,
and from there the two outputs are different but equally greedy. A
divergence anywhere else is an error. The demo's ``--compare`` and the tests
use this rule.
"""

from __future__ import annotations

from typing import Any

# Log-probability gap below which greedy decoding is numerically ambiguous in
# bf16 (batched verification and one-token decoding may round either way).
# The largest gap seen to flip a greedy token is 0.125, four bf16 steps of
# logits near 4.5: on a CPU with AMX / AVX-512 bf16 units, stock DFlash and
# DDTree (B = 1 and 8) alike took the runner-up there on the fixture hybrid
# target, while no-spec decoding gave the same token at every batch size
# (2026-12-05; the rule was 0.1 before).
TIE = 0.15


def top2_gaps(output: Any) -> list[float]:
    """Per generated token of a ``RequestOutput``, the gap between the two
    best log-probabilities (the request must have asked for ``logprobs >=
    2``)."""
    gaps = []
    for lp in output.outputs[0].logprobs:
        top = sorted((x.logprob for x in lp.values()), reverse=True)
        gaps.append(top[0] - top[1])
    return gaps


def first_divergence(want: list[int], have: list[int]) -> int | None:
    """Index of the first token where ``have`` leaves ``want`` (the shorter
    one's length if one is a prefix of the other); ``None`` if equal."""
    pairs = enumerate(zip(want, have, strict=False))
    d = next((i for i, (a, b) in pairs if a != b), None)
    if d is None and len(want) != len(have):
        d = min(len(want), len(have))
    return d


def diverges_off_tie(
    want: list[int], gaps: list[float], have: list[int], tie: float = TIE
) -> int | None:
    """Where ``have`` first leaves the greedy output ``want`` at a token whose
    top-2 gap (``gaps``, of ``want``'s run) is at least ``tie``; ``None``
    when the outputs agree, or first differ at a near-tie."""
    d = first_divergence(want, have)
    if d is None or (d < len(gaps) and gaps[d] < tie):
        return None
    return d
