# SPDX-License-Identifier: Apache-2.0
"""``vllm-ddtree serve`` with DDTree on a CUDA GPU (CUDA graphs on), through
the OpenAI client on loopback: chat and completions, streaming and not, and
greedy output equal to a no-spec server's.

Run on the device machine: ``python -m pytest tests/gpu/test_serve_gpu.py -q``.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

from tests.utils import OpenAIServer, chat_once_and_streamed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = ["the cat sat", "one two three", "def f(x):"]


def _serve_args(spec: dict | None) -> list[str]:
    args = [
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "256",
        "--kv-cache-memory-bytes",
        str(1 << 30),
        "--gpu-memory-utilization",
        "0.3",
    ]
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec)]
    return args


def _completions(url: str, stream: bool) -> list[str]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    texts = []
    for prompt in PROMPTS:
        kwargs = dict(model="tiny", prompt=prompt, max_tokens=32, temperature=0)
        if stream:
            chunks = client.completions.create(**kwargs, stream=True)
            texts.append("".join(c.choices[0].text for c in chunks))
        else:
            texts.append(client.completions.create(**kwargs).choices[0].text)
    return texts


def test_serve_ddtree_equals_no_spec(fixtures):
    with OpenAIServer(fixtures.dense_target, _serve_args(None)) as srv:
        expected = _completions(srv.url, stream=False)
    spec = {
        "method": "ddtree",
        "model": str(fixtures.dense_drafter),
        "num_speculative_tokens": 16,
    }
    with OpenAIServer(fixtures.dense_target, _serve_args(spec)) as srv:
        assert _completions(srv.url, stream=False) == expected
        assert _completions(srv.url, stream=True) == expected
        full, streamed = chat_once_and_streamed(srv.url)
        assert full and streamed == full
