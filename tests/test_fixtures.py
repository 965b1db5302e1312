# SPDX-License-Identifier: Apache-2.0
"""The generated fixture models: deterministic, consistent, and well-behaved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from vllm_ddtree import fixtures as fx

MODEL_FIELDS = ("dense_target", "dense_drafter", "hybrid_target", "hybrid_drafter")
PAIRS = (("dense_target", "dense_drafter"), ("hybrid_target", "hybrid_drafter"))


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "FIXTURE_STAMP"
    }


def test_generation_is_deterministic(tmp_path, fixtures):
    a = fx.build_fixtures(tmp_path / "a")
    b = fx.build_fixtures(tmp_path / "b")
    files_a, files_b = _files(a.root), _files(b.root)
    assert files_a.keys() == files_b.keys()
    assert sum(k.endswith(".safetensors") for k in files_a) == 4
    for name in files_a:
        assert files_a[name] == files_b[name], f"{name} differs between builds"
    # The cached fixtures come from the same generator (the stamp works).
    cached = _files(fixtures.root)
    for name, data in files_a.items():
        if name.endswith(".safetensors"):
            assert cached[name] == data, f"cached {name} is stale"


def test_cache_is_reused_and_complete(fixtures):
    assert (fixtures.root / "FIXTURE_STAMP").read_text().strip() == fx.fixture_stamp()
    assert fx.fixture_paths(fixtures.root) == fixtures
    total = 0
    for field in MODEL_FIELDS:
        path = getattr(fixtures, field)
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            assert (path / name).is_file(), f"{field}/{name} missing"
        total += sum(p.stat().st_size for p in path.iterdir())
    assert total < 5 * 2**20


def test_tokenizer(fixtures):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fixtures.tokenizer)
    assert 256 <= len(tok) <= 512
    assert tok.eos_token == fx.EOS_TOKEN and tok.eos_token_id is not None
    assert tok.mask_token == fx.MASK_TOKEN
    text = "Hello world, what is the capital of France?"
    assert tok.decode(tok(text).input_ids) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("target_field,drafter_field", PAIRS)
def test_drafter_matches_target(fixtures, target_field, drafter_field):
    from transformers import AutoTokenizer

    target = _config(getattr(fixtures, target_field))
    drafter = _config(getattr(fixtures, drafter_field))
    tok = AutoTokenizer.from_pretrained(getattr(fixtures, drafter_field))

    assert drafter["architectures"] == ["DFlashDraftModel"]
    assert drafter["hidden_size"] == target["hidden_size"]
    assert drafter["vocab_size"] == target["vocab_size"] >= len(tok)
    assert drafter["num_target_layers"] == target["num_hidden_layers"]
    assert drafter["block_size"] == fx.DFLASH_BLOCK_SIZE
    dflash = drafter["dflash_config"]
    layer_ids = dflash["target_layer_ids"]
    assert layer_ids and all(0 <= i < target["num_hidden_layers"] for i in layer_ids)
    assert 0 <= dflash["mask_token_id"] < len(tok) <= target["vocab_size"]
    assert dflash["mask_token_id"] == tok.mask_token_id
    assert dflash["mask_token_id"] != tok.eos_token_id

    # Checkpoint names as vLLM's DFlash loader expects them: no own embedding
    # or lm_head (shared with the target), fc over the target layers.
    path = getattr(fixtures, drafter_field) / "model.safetensors"
    with safe_open(path, "pt") as f:
        names = set(f.keys())
        fc = f.get_tensor("fc.weight")
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    assert all(n.startswith(("layers.", "fc.", "hidden_norm.", "norm.")) for n in names)
    assert fc.shape == (target["hidden_size"], len(layer_ids) * target["hidden_size"])


def test_hybrid_layout(fixtures):
    cfg = _config(fixtures.hybrid_target)
    assert cfg["model_type"] == "qwen3_next"
    kinds = cfg["layer_types"]
    assert len(kinds) == cfg["num_hidden_layers"]
    assert "linear_attention" in kinds and "full_attention" in kinds
    assert cfg["num_experts"] > 0


PROMPTS = (
    "The little harbour town",
    "A computer is a machine that",
    "What is the capital of France?",
    "1 2 3 4 5",
)


@pytest.mark.parametrize("field", ["dense_target", "hybrid_target"])
def test_greedy_is_robust_and_varied(fixtures, field):
    """Reference (transformers, fp32) greedy decoding has large top-1 margins
    and does not collapse into repeating one token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = getattr(fixtures, field)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    specials = set(tok.all_special_ids)
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=32,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=tok.eos_token_id,
            )
        new = out.sequences[0, ids.shape[1] :].tolist()
        assert len(new) == 32
        assert len(set(new)) >= 8, f"{prompt!r}: output too repetitive: {new}"
        assert not specials & set(new)
        for scores in out.scores:
            top2 = scores[0].topk(2).values
            margin = (top2[0] - top2[1]) / scores[0].std()
            assert margin > 0.5, f"{prompt!r}: near-tie in greedy decoding"
