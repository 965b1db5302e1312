# SPDX-License-Identifier: Apache-2.0
"""Train a small Qwen3 code LM and distill a DFlash drafter from it.

    python -m vllm_ddtree.training.train_pair --preset tiny --out DIR   # CPU
    python -m vllm_ddtree.training.train_pair --preset h200 --out DIR   # GPU

Steps (every random choice comes from ``--seed``):

1. corpus: Python sources of the installation (:mod:`.corpus`), one file in
   32 held out; a byte-level BPE tokenizer is trained on the rest;
2. target: a ``Qwen3ForCausalLM`` trained on random windows of the token
   stream (next-token loss);
3. distillation data: the target's own greedy continuations of random
   training windows (so, at every anchor inside a continuation, the following
   tokens *are* the target's greedy continuation from that anchor);
4. drafter: DFlash blocks ``[token at anchor, MASK x 15]`` at random anchors
   inside the continuations, conditioned on the target's tapped hidden states
   of the positions before the anchor, cross-entropy against the next 15
   tokens with weight ``exp(-(k-1)/gamma)`` at block slot ``k``;
5. output: ``DIR/target`` and ``DIR/dflash`` (HF layout, bf16; vLLM loads
   them as ``model`` and as a ``dflash`` / ``ddtree`` drafter),
   ``DIR/prompts.jsonl`` (evaluation prompts cut from held-out files, as token
   ids and text) and ``DIR/training.json`` (settings, corpus fingerprint,
   losses and the drafter's measured greedy acceptance on held-out text).

``--max-minutes`` fits the run into a fixed-length call: a training phase
whose planned steps would overrun its share of the limit (target: the first
half, drafter: up to 90 %) re-plans its length and learning-rate schedule from
the measured step time (``training.json`` records the steps run).  Such a run
depends on the machine's speed; a run whose limit never binds is determined by
the preset and ``--seed`` alone (same device type).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_ddtree.fixtures import MASK_TOKEN, build_tokenizer, save_model
from vllm_ddtree.training import corpus
from vllm_ddtree.training.dflash_model import (
    DFlashDrafter,
    DrafterSpec,
    tapped_features,
)


@dataclass(frozen=True)
class Preset:
    # corpus / tokenizer
    corpus_roots: tuple[str, ...]
    corpus_bytes: int
    vocab_size: int
    # target
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_embeddings: bool
    seq_len: int
    batch_size: int
    target_steps: int
    target_lr: float
    # distillation data
    prompt_len: int
    gen_len: int
    gen_seqs: int
    gen_batch: int
    # drafter
    draft_layers: int
    draft_intermediate: int
    target_layer_ids: tuple[int, ...]
    anchors_per_seq: int
    draft_batch: int
    draft_steps: int
    draft_lr: float
    # evaluation prompts (held-out files)
    eval_prompts: int
    eval_prompt_len: int
    head_dim: int = 64
    block_size: int = 16
    decay_gamma: float = 7.0
    rope_theta: float = 10_000.0
    max_position_embeddings: int = 4096


PRESETS: dict[str, Preset] = {
    # Commit-sized pair (~7 MB bf16) that trains on two CPU cores in minutes.
    "tiny": Preset(
        corpus_roots=("stdlib",),
        corpus_bytes=8 << 20,
        vocab_size=2048,
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=512,
        tie_embeddings=True,
        seq_len=256,
        batch_size=16,
        target_steps=600,
        target_lr=3e-3,
        prompt_len=32,
        gen_len=96,
        gen_seqs=512,
        gen_batch=128,
        draft_layers=1,
        draft_intermediate=512,
        target_layer_ids=(1, 2),
        anchors_per_seq=8,
        draft_batch=16,
        draft_steps=400,
        draft_lr=2e-3,
        eval_prompts=64,
        eval_prompt_len=64,
    ),
    # ~110M-parameter target and a 3-layer drafter for one H200 in one
    # 10-minute call (regenerated on demand, never committed).
    "h200": Preset(
        corpus_roots=("stdlib", "torch", "transformers", "numpy"),
        corpus_bytes=96 << 20,
        vocab_size=8192,
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        intermediate_size=2048,
        tie_embeddings=False,
        seq_len=512,
        batch_size=64,
        target_steps=3000,
        target_lr=1.5e-3,
        prompt_len=64,
        gen_len=192,
        gen_seqs=8192,
        gen_batch=1024,
        draft_layers=3,
        draft_intermediate=2048,
        target_layer_ids=(1, 4, 7, 10),
        anchors_per_seq=16,
        draft_batch=64,
        draft_steps=2500,
        draft_lr=1e-3,
        eval_prompts=256,
        eval_prompt_len=128,
    ),
    # Seconds-long end-to-end check of this script (tests, CI).
    "smoke": Preset(
        corpus_roots=("stdlib",),
        corpus_bytes=1 << 20,
        vocab_size=512,
        hidden_size=64,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        tie_embeddings=True,
        seq_len=64,
        batch_size=4,
        target_steps=4,
        target_lr=1e-3,
        prompt_len=16,
        gen_len=32,
        gen_seqs=8,
        gen_batch=8,
        draft_layers=1,
        draft_intermediate=128,
        target_layer_ids=(0, 1),
        anchors_per_seq=2,
        draft_batch=4,
        draft_steps=4,
        draft_lr=1e-3,
        eval_prompts=4,
        eval_prompt_len=16,
    ),
}


def _log(msg: str) -> None:
    print(f"[train_pair {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------
# Optimization
# ----------------------------------------------------------------------------


def _optimize(
    name: str,
    params: Sequence[torch.nn.Parameter],
    loss_fn: Callable[[], tuple[torch.Tensor, dict[str, float]]],
    steps: int,
    lr: float,
    deadline: float,
) -> dict:
    """AdamW with linear warm-up and cosine decay to lr/10.

    Every few steps the length is re-planned from the recent step time: if
    ``steps`` would not end by ``deadline`` (``time.monotonic()``), the run
    is shortened to what fits (or lengthened again, up to ``steps``) and the
    cosine schedule follows, so a time-limited run on a shared machine still
    ends annealed.  The step count actually run is returned.
    """
    fused = params[0].is_cuda
    opt = torch.optim.AdamW(
        params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=fused
    )
    planned, total = steps, steps
    warmup = max(1, steps // 20)
    replan_every = 10

    def factor(step: int) -> float:
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, step / total)))
        return min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * cosine)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    start = window_start = time.monotonic()
    stats: dict[str, float] = {}
    done = 0
    while done < total:
        loss, stats = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        done += 1
        now = time.monotonic()
        rate = (now - start) / done
        if done % replan_every == 0:
            recent = (now - window_start) / replan_every
            window_start = now
            fits = done + int(max(0.0, deadline - now) / recent)
            if min(fits, planned) != total:
                total = max(done, min(fits, planned))
                _log(f"{name}: re-planned to {total} of {planned} steps (time limit)")
        if (done - 1) % max(1, total // 20) == 0 or done == total:
            shown = " ".join(f"{k}={v:.3f}" for k, v in stats.items())
            _log(f"{name} step {done}/{total} {shown} ({rate:.2f} s/step)")
    return {
        "steps": done,
        "planned_steps": planned,
        **stats,
        "seconds": time.monotonic() - start,
    }


# ----------------------------------------------------------------------------
# Target
# ----------------------------------------------------------------------------


def target_config(p: Preset, tok, vocab: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=vocab,
        hidden_size=p.hidden_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        intermediate_size=p.intermediate_size,
        max_position_embeddings=p.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": p.rope_theta},
        tie_word_embeddings=p.tie_embeddings,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="bfloat16",
    )


def _windows(
    stream: torch.Tensor, n: int, length: int, gen: torch.Generator
) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - length, (n,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def train_target(model, stream, p: Preset, steps, device, gen, deadline) -> dict:
    model.train()

    def loss_fn():
        x = _windows(stream, p.batch_size, p.seq_len, gen).to(device)
        with _autocast(device):
            loss = model(input_ids=x, labels=x).loss
        return loss, {"loss": loss.item()}

    return _optimize(
        "target", list(model.parameters()), loss_fn, steps, p.target_lr, deadline
    )


@torch.no_grad()
def greedy_continue(model, prompts: torch.Tensor, n_new: int, batch: int, device):
    """``prompts`` ``[N, P]`` followed by ``n_new`` greedy tokens each."""
    from transformers import DynamicCache

    model.eval()
    out = []
    for chunk in prompts.split(batch):
        chunk = chunk.to(device)
        cache = DynamicCache()
        tokens, step_in = [chunk], chunk
        for _ in range(n_new):
            with _autocast(device):
                logits = model(
                    input_ids=step_in, past_key_values=cache, use_cache=True
                ).logits
            step_in = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(step_in)
        out.append(torch.cat(tokens, dim=1).cpu())
    return torch.cat(out)


def _autocast(device: torch.device):
    return torch.autocast(
        device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"
    )


# ----------------------------------------------------------------------------
# Drafter
# ----------------------------------------------------------------------------


def drafter_spec(p: Preset, vocab: int, mask_id: int) -> DrafterSpec:
    if max(p.target_layer_ids) > p.num_layers - 2:
        # HF reports the last layer's output after the final norm; vLLM taps it
        # before. Keep to layers where both agree.
        raise ValueError("target_layer_ids must be <= num_layers - 2")
    return DrafterSpec(
        hidden_size=p.hidden_size,
        num_layers=p.draft_layers,
        num_heads=p.num_heads,
        num_kv_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        intermediate_size=p.draft_intermediate,
        target_hidden_size=p.hidden_size,
        target_layer_ids=p.target_layer_ids,
        num_target_layers=p.num_layers,
        vocab_size=vocab,
        mask_token_id=mask_id,
        block_size=p.block_size,
        rope_theta=p.rope_theta,
        max_position_embeddings=p.max_position_embeddings,
    )


def init_drafter_from_target(drafter: DFlashDrafter, target) -> None:
    """Start the drafter's layers from the target's top layers (same names
    and, when the sizes agree, same shapes): much faster to distill than
    from noise."""
    src_layers = target.model.layers[-len(drafter.layers) :]
    for dst, src in zip(drafter.layers, src_layers, strict=True):
        src_state = src.state_dict()
        own = dst.state_dict()
        if all(
            k in src_state and src_state[k].shape == v.shape for k, v in own.items()
        ):
            dst.load_state_dict({k: src_state[k] for k in own})


class DraftBatches:
    """Blocks, labels and target features for drafter training / evaluation."""

    def __init__(self, target, spec: DrafterSpec, p: Preset, device) -> None:
        self.target, self.spec, self.p, self.device = target, spec, p, device

    def loss(
        self, drafter: DFlashDrafter, seqs: torch.Tensor, anchors: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Position-decayed cross-entropy and greedy acceptance statistics of
        blocks at ``anchors`` ``[B, K]`` of ``seqs`` ``[B, S]``."""
        bs, spec = self.spec.block_size, self.spec
        seqs, anchors = seqs.to(self.device), anchors.to(self.device)
        with torch.no_grad(), _autocast(self.device):
            hs = self.target.model(input_ids=seqs, output_hidden_states=True)
            features = tapped_features(hs.hidden_states, spec.target_layer_ids)
        offsets = torch.arange(bs, device=self.device)
        block = seqs.gather(1, (anchors[:, :, None] + offsets).flatten(1))
        block = block.view(*anchors.shape, bs)
        labels = block[:, :, 1:]
        inputs = torch.full_like(block, spec.mask_token_id)
        inputs[:, :, 0] = block[:, :, 0]
        embed = self.target.get_input_embeddings()
        with _autocast(self.device):
            hidden = drafter(embed(inputs.flatten(1)), features, anchors)
            hidden = hidden.view(*block.shape, -1)[:, :, 1:]
            logits = self.target.lm_head(hidden).float()
        ce = F.cross_entropy(
            logits.flatten(0, 2), labels.flatten(), reduction="none"
        ).view(labels.shape)
        weights = torch.exp(-offsets[:-1].float() / self.p.decay_gamma)
        loss = (ce * weights).sum(-1).mean() / weights.sum()
        hits = (logits.argmax(-1) == labels).float()
        accepted = hits.cumprod(-1).sum(-1)
        return loss, {
            "loss": loss.item(),
            "acc1": hits[..., 0].mean().item(),
            "tau": 1.0 + accepted.mean().item(),
        }

    def random_anchors(self, n: int, seq_len: int, gen: torch.Generator):
        lo, hi = self.p.prompt_len, seq_len - self.spec.block_size + 1
        return torch.randint(lo, hi, (n, self.p.anchors_per_seq), generator=gen)


def train_drafter(drafter, batches: DraftBatches, data, steps, device, gen, deadline):
    p = batches.p
    drafter.train()

    def loss_fn():
        rows = torch.randint(0, len(data), (p.draft_batch,), generator=gen)
        anchors = batches.random_anchors(p.draft_batch, data.shape[1], gen)
        return batches.loss(drafter, data[rows], anchors)

    return _optimize(
        "drafter", list(drafter.parameters()), loss_fn, steps, p.draft_lr, deadline
    )


@torch.no_grad()
def evaluate_drafter(drafter, batches: DraftBatches, data, gen) -> dict[str, float]:
    """Mean greedy statistics over all rows of ``data`` (held-out text)."""
    drafter.eval()
    totals: dict[str, float] = {}
    chunks = data.split(batches.p.draft_batch)
    for chunk in chunks:
        anchors = batches.random_anchors(len(chunk), data.shape[1], gen)
        _, stats = batches.loss(drafter, chunk, anchors)
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + v / len(chunks)
    return totals


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def _param_mb(module) -> float:
    return sum(t.numel() for t in module.state_dict().values()) * 2 / 2**20


def train_pair(
    p: Preset,
    out: Path,
    device: torch.device,
    seed: int,
    max_minutes: float,
    target_from: Path | None = None,
) -> dict:
    """Run the whole recipe (module docstring); with ``target_from`` (a
    pair written earlier with the same preset) keep its tokenizer and target
    and only distill a new drafter."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    start = time.monotonic()
    budget = max_minutes * 60

    def deadline(share: float) -> float:
        return start + share * budget

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)

    files = corpus.list_files(p.corpus_roots, p.corpus_bytes)
    train_files = [f for f in files if not f.held_out]
    heldout_files = [f for f in files if f.held_out]
    _log(f"corpus: {len(train_files)} train / {len(heldout_files)} held-out files")
    if target_from is None:
        tok = build_tokenizer(corpus.iter_lines(train_files), p.vocab_size)
    else:
        tok = AutoTokenizer.from_pretrained(target_from / "target")
    vocab = -(-len(tok) // 64) * 64
    mask_id = tok.convert_tokens_to_ids(MASK_TOKEN)
    stream = torch.tensor(corpus.token_stream(tok, train_files))
    _log(f"tokenizer: {len(tok)} tokens; train stream {len(stream)} tokens")

    if target_from is None:
        cfg = target_config(p, tok, vocab)
        target = Qwen3ForCausalLM(cfg).to(device)
        _log(f"target: {_param_mb(target):.1f} MB bf16")
        target_stats = train_target(
            target, stream, p, p.target_steps, device, gen, deadline(0.5)
        )
    else:
        target = Qwen3ForCausalLM.from_pretrained(
            target_from / "target", dtype=torch.float32
        ).to(device)
        cfg = target.config
        previous = json.loads((target_from / "training.json").read_text())
        target_stats = {"from": str(target_from), **previous["target"]}

    target.eval().requires_grad_(False)
    prompts = _windows(stream, p.gen_seqs, p.prompt_len, gen)
    data = greedy_continue(target, prompts, p.gen_len, p.gen_batch, device)
    _log(f"distillation data: {tuple(data.shape)} target greedy continuations")

    spec = drafter_spec(p, vocab, mask_id)
    drafter = DFlashDrafter(spec).to(device)
    init_drafter_from_target(drafter, target)
    _log(f"drafter: {_param_mb(drafter):.1f} MB bf16")
    batches = DraftBatches(target, spec, p, device)
    draft_stats = train_drafter(
        drafter, batches, data, p.draft_steps, device, gen, deadline(0.9)
    )

    eval_prompts = corpus.heldout_prompts(
        tok, heldout_files, p.eval_prompts, p.eval_prompt_len
    )
    eval_data = greedy_continue(
        target,
        torch.tensor(eval_prompts)[:, -p.prompt_len :],
        p.gen_len,
        p.gen_batch,
        device,
    )
    heldout = evaluate_drafter(drafter, batches, eval_data, gen)
    _log(f"held-out greedy drafter stats: {heldout}")

    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().cpu() for k, v in target.state_dict().items()}
    if p.tie_embeddings:
        del weights["lm_head.weight"]
    save_model(out / "target", cfg, weights, tok)
    drafter.cpu().save(out / "dflash", tok, tok.eos_token_id, tok.pad_token_id)
    with open(out / "prompts.jsonl", "w") as fh:
        for ids in eval_prompts:
            fh.write(json.dumps({"prompt_token_ids": ids, "text": tok.decode(ids)}))
            fh.write("\n")
    report = {
        "preset": dataclasses.asdict(p),
        "seed": seed,
        "device": str(device),
        "torch": torch.__version__,
        "corpus": {
            "files": len(files),
            "heldout_files": len(heldout_files),
            "fingerprint": corpus.fingerprint(files),
            "train_tokens": len(stream),
        },
        "target": target_stats,
        "drafter": draft_stats,
        "heldout_greedy": heldout,
        "seconds": time.monotonic() - start,
    }
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    _log(f"wrote {out} in {report['seconds']:.0f} s")
    return report


def apply_overrides(preset: Preset, items: Sequence[str]) -> Preset:
    """``preset`` with ``FIELD=VALUE`` items applied (values parsed as
    JSON, so ``target_layer_ids=[1,4]`` and ``corpus_roots=["stdlib"]``
    work)."""
    fields = {f.name for f in dataclasses.fields(Preset)}
    changes = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in fields:
            raise SystemExit(
                f"--set {item!r}: expected FIELD=VALUE, FIELD in {sorted(fields)}"
            )
        parsed = json.loads(value)
        changes[name] = tuple(parsed) if isinstance(parsed, list) else parsed
    return dataclasses.replace(preset, **changes)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-steps", type=int, help="override the preset")
    ap.add_argument("--draft-steps", type=int, help="override the preset")
    ap.add_argument(
        "--target-from",
        type=Path,
        help="reuse the tokenizer and target of this pair; train a new drafter",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override any preset field (repeatable)",
    )
    ap.add_argument(
        "--max-minutes",
        type=float,
        default=60.0,
        help="wall-clock limit: phases shorten their schedules to fit it",
    )
    args = ap.parse_args(argv)
    items = list(args.set)
    if args.target_steps is not None:
        items.append(f"target_steps={args.target_steps}")
    if args.draft_steps is not None:
        items.append(f"draft_steps={args.draft_steps}")
    preset = apply_overrides(PRESETS[args.preset], items)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    train_pair(
        preset,
        args.out,
        torch.device(args.device),
        args.seed,
        args.max_minutes,
        target_from=args.target_from,
    )


if __name__ == "__main__":
    main()
