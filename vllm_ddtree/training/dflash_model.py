# SPDX-License-Identifier: Apache-2.0
"""A DFlash drafter in plain torch, with the checkpoint layout vLLM loads.

vLLM's ``DFlashDraftModel`` (``model_executor/models/qwen3_dflash.py``)
computes, per request and round, with ``n`` committed tokens and the bonus
token ``b`` at position ``n``:

* context: ``c = hidden_norm(fc(concat of the target's hidden states after
  the layers in target_layer_ids))`` for positions ``0..n-1``; every drafter
  layer turns ``c`` into keys / values with its own ``k_proj`` / ``k_norm`` /
  RoPE and ``v_proj`` (no input layernorm on this path);
* queries: the block ``[b, MASK x (block_size-1)]`` at positions
  ``n..n+block_size-1`` runs through pre-norm Qwen3 decoder layers whose
  attention is non-causal over ``context + block``; the final ``norm`` and
  the *target's* ``lm_head`` give the logits; block slot ``j`` predicts the
  token at position ``n + j``.

:class:`DFlashDrafter` computes the same thing for many blocks at once (one
per anchor, each seeing only the context before its anchor), which is what
training needs; with one block and a full context it is the inference step
(used by ``benchmarks/reference_ddtree.py``).  The embedding and the
``lm_head`` belong to the target and are passed in, never stored here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DrafterSpec:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_hidden_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    vocab_size: int
    mask_token_id: int
    block_size: int = 16
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096

    def hf_config(self, eos_token_id: int, pad_token_id: int):
        """The ``DFlashDraftModel`` config vLLM reads."""
        from transformers import Qwen3Config

        return Qwen3Config(
            architectures=["DFlashDraftModel"],
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            tie_word_embeddings=False,
            block_size=self.block_size,
            num_target_layers=self.num_target_layers,
            target_hidden_size=self.target_hidden_size,
            dflash_config={
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
            bos_token_id=eos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            dtype="bfloat16",
        )

    @classmethod
    def from_hf_config(cls, cfg: dict, target_hidden_size: int) -> DrafterSpec:
        dflash = cfg["dflash_config"]
        rope = cfg.get("rope_parameters") or {}
        return cls(
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg["num_key_value_heads"],
            head_dim=cfg["head_dim"],
            intermediate_size=cfg["intermediate_size"],
            target_hidden_size=cfg.get("target_hidden_size", target_hidden_size),
            target_layer_ids=tuple(dflash["target_layer_ids"]),
            num_target_layers=cfg["num_target_layers"],
            vocab_size=cfg["vocab_size"],
            mask_token_id=dflash["mask_token_id"],
            block_size=cfg["block_size"],
            rope_theta=rope.get("rope_theta", 1_000_000.0),
            rms_norm_eps=cfg["rms_norm_eps"],
            max_position_embeddings=cfg["max_position_embeddings"],
        )


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (Qwen3's): ``x`` is ``[B, heads, T, D]``,
    ``positions`` is ``[B, T]``."""
    dim = x.shape[-1]
    inv_freq = theta ** (
        -torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim
    )
    angles = positions.float()[:, None, :, None] * inv_freq  # [B, 1, T, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        h, hd = spec.hidden_size, spec.head_dim
        self.spec = spec
        self.q_proj = nn.Linear(h, spec.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, spec.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(spec.num_heads * hd, h, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=spec.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=spec.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.spec.head_dim).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        positions: torch.Tensor,
        context_positions: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        s, theta = self.spec, self.spec.rope_theta
        q = self.q_norm(self._heads(self.q_proj(x), s.num_heads))
        q = apply_rope(q, positions, theta)
        keys, values = [], []
        for src, pos in ((context, context_positions), (x, positions)):
            k = self.k_norm(self._heads(self.k_proj(src), s.num_kv_heads))
            keys.append(apply_rope(k, pos, theta))
            values.append(self._heads(self.v_proj(src), s.num_kv_heads))
        out = F.scaled_dot_product_attention(
            q,
            torch.cat(keys, dim=2),
            torch.cat(values, dim=2),
            attn_mask=mask,
            enable_gqa=s.num_heads != s.num_kv_heads,
        )
        return self.o_proj(out.transpose(1, 2).flatten(2))


class _MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.self_attn = _Attention(spec)
        self.post_attention_layernorm = nn.RMSNorm(
            spec.hidden_size, eps=spec.rms_norm_eps
        )
        self.mlp = _MLP(spec.hidden_size, spec.intermediate_size)

    def forward(self, x, context, positions, context_positions, mask):
        x = x + self.self_attn(
            self.input_layernorm(x), context, positions, context_positions, mask
        )
        return x + self.mlp(self.post_attention_layernorm(x))


def block_attention_mask(
    anchors: torch.Tensor, context_len: int, block_size: int
) -> torch.Tensor:
    """Boolean mask ``[B, 1, K*bs, context_len + K*bs]`` for ``K`` blocks per
    row: block ``k`` sees the context before ``anchors[:, k]`` and its own
    ``bs`` slots (non-causally), nothing else."""
    b, k = anchors.shape
    dev = anchors.device
    q_block = torch.arange(k, device=dev).repeat_interleave(block_size)  # [Q]
    ctx_ok = (
        torch.arange(context_len, device=dev)[None, None, :] < anchors[:, q_block, None]
    )  # [B, Q, C]
    blk_ok = (q_block[:, None] == q_block[None, :]).expand(b, -1, -1)  # [B, Q, Q]
    return torch.cat([ctx_ok, blk_ok], dim=-1)[:, None]


class DFlashDrafter(nn.Module):
    """The drafter's own weights, named as in a vLLM DFlash checkpoint."""

    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleList(_Layer(spec) for _ in range(spec.num_layers))
        self.fc = nn.Linear(
            spec.target_hidden_size * len(spec.target_layer_ids),
            spec.hidden_size,
            bias=False,
        )
        self.hidden_norm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.norm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)

    def forward(
        self,
        block_embeds: torch.Tensor,
        features: torch.Tensor,
        anchors: torch.Tensor,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[B, K*bs, H]`` of ``K`` blocks per row.

        ``block_embeds`` ``[B, K*bs, H]``: target embeddings of the blocks
        ``[token at anchor, MASK, ...]``; ``features`` ``[B, C, n*Ht]``: the
        tapped target hidden states of positions ``0..C-1``; ``anchors``
        ``[B, K]``: each block's first position (its context is ``< anchor``).
        """
        bs = self.spec.block_size
        b, c = features.shape[:2]
        dev = features.device
        positions = (anchors[:, :, None] + torch.arange(bs, device=dev)).flatten(1)
        context_positions = torch.arange(c, device=dev).expand(b, c)
        mask = block_attention_mask(anchors, c, bs)
        context = self.hidden_norm(self.fc(features))
        x = block_embeds
        for layer in self.layers:
            x = layer(x, context, positions, context_positions, mask)
        return self.norm(x)

    def save(self, out: Path, tokenizer, eos_token_id: int, pad_token_id: int) -> None:
        from vllm_ddtree.fixtures import save_model

        cfg = self.spec.hf_config(eos_token_id, pad_token_id)
        save_model(out, cfg, dict(self.state_dict()), tokenizer)

    @classmethod
    def load(cls, path: Path | str, target_hidden_size: int) -> DFlashDrafter:
        from safetensors.torch import load_file

        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        drafter = cls(DrafterSpec.from_hf_config(cfg, target_hidden_size))
        drafter.load_state_dict(load_file(path / "model.safetensors"))
        return drafter


def tapped_features(hidden_states: tuple[torch.Tensor, ...], layer_ids) -> torch.Tensor:
    """Concatenate the target's outputs of ``layer_ids`` from an HF
    ``output_hidden_states`` tuple (entry ``i + 1`` is layer ``i``'s output;
    vLLM taps the same residual stream, ``aux layer = id + 1``)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)
