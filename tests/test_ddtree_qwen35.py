"""Greedy DDTree equals no-spec decoding on a Qwen3.5 (M-RoPE) hybrid target.

Qwen3.5 checkpoints are ``Qwen3_5ForConditionalGeneration``: the Qwen Gated
DeltaNet layers of Qwen3-Next plus a vision tower, with M-RoPE positions
(three rows: time, height, width). A generated token's three positions are
equal, so a tree node's rows move together to the root's position plus the
node's depth. The target here is a small random one (vision tower included,
served with ``language_model_only``), with the fixture hybrid drafter (its
embedding and head come from the target) led by the oracle drafter. The
control test shows the M-RoPE rows matter: moving only the 1-D positions
changes the outputs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from vllm import LLM

from tests.oracle_drafter import Oracle
from tests.test_ddtree_hybrid import no_spec_reference, oracle_tree_run
from tests.utils import (
    cpu_async_scheduling,
    ddtree_config,
    make_llm,
    shutdown_llm,
)

pytestmark = pytest.mark.slow

NUM_PROMPTS = 8
VOCAB = 16
LOGIT_GAIN = 4.0
ENGINE_ARGS = dict(max_num_batched_tokens=256, max_num_seqs=8, language_model_only=True)


def _prompts() -> list[list[int]]:
    return [
        [(29 * i + 7 * j) % (VOCAB - 5) + 5 for j in range(3 + (i * 5) % 11)]
        for i in range(NUM_PROMPTS - 1)
    ] + [[(11 * j) % (VOCAB - 7) + 7 for j in range(120)]]  # chunked


def make_qwen35_target(out: Path, vocab_size: int, hidden_size: int) -> Path:
    """A small random ``Qwen3_5ForConditionalGeneration`` (3 GDN layers, 1
    full-attention layer, M-RoPE, a one-block vision tower) in ``out``."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        # Rotary over whole heads at a short wavelength: positions matter.
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 100.0,
            "partial_rotary_factor": 1.0,
            "mrope_section": [16, 8, 8],
            "mrope_interleaved": True,
        },
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=64,
        out_hidden_size=hidden_size,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
        deepstack_visual_indexes=[],
    )
    config = Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        architectures=["Qwen3_5ForConditionalGeneration"],
        image_token_id=vocab_size + 1,
        video_token_id=vocab_size + 2,
        vision_start_token_id=vocab_size + 3,
        vision_end_token_id=vocab_size + 4,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                # Unit-variance layers and a sharper head (fewer near-ties).
                gain = LOGIT_GAIN if name.endswith("lm_head.weight") else 1.0
                param.normal_(0.0, gain / param.shape[-1] ** 0.5)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models(fixtures, tmp_path_factory) -> tuple[Path, Path]:
    """The Qwen3.5 target and the fixture hybrid drafter set to its
    vocabulary (the drafter has no vocabulary-sized weights: vLLM shares
    the target's embedding and head with it); the engines run on token ids."""
    config = json.loads((fixtures.hybrid_drafter / "config.json").read_text())
    root = tmp_path_factory.mktemp("qwen35")
    target = make_qwen35_target(root / "target", VOCAB, config["hidden_size"])
    drafter = root / "dflash"
    drafter.mkdir()
    shutil.copy(fixtures.hybrid_drafter / "model.safetensors", drafter)
    config["vocab_size"] = VOCAB
    (drafter / "config.json").write_text(json.dumps(config))
    return target, drafter


def qwen35_engine(target: Path, **engine_args) -> LLM:
    """A no-spec engine of the Qwen3.5 target (on M-RoPE positions)."""
    llm = make_llm(target, skip_tokenizer_init=True, **ENGINE_ARGS, **engine_args)
    assert llm.llm_engine.vllm_config.model_config.uses_mrope
    return llm


def qwen35_reference(llm: LLM) -> list[list[int]]:
    """No-spec greedy outputs of :func:`qwen35_engine`'s engine, each cut
    before its first near-tie."""
    # A random model meets bf16 near-ties often: 30% of the tokens come
    # before each output's first one on an AMX CPU (the comparison's
    # substance; the bound leaves room for other CPUs' rounding).
    return no_spec_reference(llm, _prompts(), min_fraction=0.2)


@pytest.fixture(scope="module")
def reference(models) -> list[list[int]]:
    llm = qwen35_engine(models[0])
    try:
        return qwen35_reference(llm)
    finally:
        shutdown_llm(llm)


def _ddtree_run(models, reference, batches, rank_weights, **engine_args):
    target, drafter = models
    prompts = _prompts()
    sequences = {tuple(p): p + o for p, o in zip(prompts, reference, strict=True)}
    return oracle_tree_run(
        target,
        ddtree_config(drafter, 8),
        Oracle(sequences, rank_weights),
        prompts,
        batches,
        skip_tokenizer_init=True,
        **ENGINE_ARGS,
        **engine_args,
    )


def _mismatches(reference, got) -> list[int]:
    return [
        i
        for i, (want, have) in enumerate(zip(reference, got, strict=True))
        if have[: len(want)] != want
    ]


# The oracle's reference token mostly first, or mostly second among siblings
# (on the top-1 spine a node's index is its depth, off it they differ).
RANKS = {"first": (0.6, 0.2, 0.1), "second": (0.2, 0.6, 0.1)}


@pytest.mark.parametrize("ranks", list(RANKS))
def test_qwen35_greedy_equals_no_spec(models, reference, ranks):
    results, tau = _ddtree_run(
        models, reference, ((8, NUM_PROMPTS), (1, 3)), RANKS[ranks]
    )
    for batch, got in results.items():
        assert not _mismatches(reference[: len(got)], got), f"batch {batch}"
    assert tau > 1.5, tau


def test_qwen35_greedy_equals_no_spec_with_async_scheduling(models, reference):
    with cpu_async_scheduling():
        results, tau = _ddtree_run(
            models,
            reference,
            ((8, NUM_PROMPTS),),
            RANKS["second"],
            async_scheduling=True,
        )
    assert not _mismatches(reference, results[8])
    assert tau > 1.5, tau


def test_control_without_mrope_rows_diverges(models, reference, monkeypatch):
    """Moving only the 1-D positions (which an M-RoPE model does not read)
    must change the outputs: the equality above depends on the rows."""
    from vllm_ddtree.v1.worker.ddtree_model_runner import DDTreeModelRunnerMixin

    def one_d_only(self, total, node_tokens, shift):
        linear = self.mrope_positions.gpu[:, :total].clone()
        self.positions[node_tokens] += shift
        return linear

    monkeypatch.setattr(
        DDTreeModelRunnerMixin, "_shift_to_mrope_depth_positions", one_d_only
    )
    results, _ = _ddtree_run(models, reference, ((8, NUM_PROMPTS),), RANKS["second"])
    assert len(_mismatches(reference, results[8])) >= NUM_PROMPTS // 3
