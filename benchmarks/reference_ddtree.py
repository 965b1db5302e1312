# SPDX-License-Identifier: Apache-2.0
"""A straightforward DDTree (Ringel et al., 2026) at batch 1, and a parity check.

The reference shares nothing with the plugin's tree code: the target is a
transformers ``Qwen3ForCausalLM`` recomputed from scratch every round (no KV
cache), the drafter is the plain-torch DFlash model of
``vllm_ddtree.training.dflash_model``, the tree comes from the paper's
best-first heap and is verified with one target forward under a dense
ancestor mask.  One round, with committed tokens ``x[0..n-1]`` and bonus
token ``b``:

1. draft: the target's tapped hidden states of ``x[0..n-1]`` condition the
   drafter on the block ``[b, MASK x 15]``; ``q_d = softmax`` of its logits at
   depth ``d = 1..15``;
2. tree: the ``B`` most probable prefixes under ``prod_d q_d`` by best-first
   search (pop the best candidate; push its next sibling and its first
   child);
3. verify: one target forward over ``x + [b] + tree`` where a node sees the
   committed tokens, the root ``b``, its ancestors and itself, at position
   ``n + depth``;
4. walk: from the root follow the target's argmax while it is a child; the
   accepted nodes are committed after ``b`` and the first argmax that is not a
   child becomes the next bonus.

``--parity`` runs the reference and the plugin (vLLM, ``method: ddtree``,
same budget) on the same prompts at T=0 and compares outputs and the mean
acceptance length tau = 1 + accepted / rounds::

    python benchmarks/reference_ddtree.py --parity --budget 32 --num-prompts 16
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_ddtree.training.dflash_model import (  # noqa: E402
    DFlashDrafter,
    tapped_features,
)


@dataclass
class Tree:
    """Nodes in best-first order; node ``i`` is index ``i + 1`` after the
    root, ``parent`` is ``-1`` for children of the root."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)


def best_first_tree(logprobs: torch.Tensor, budget: int) -> Tree:
    """The ``budget`` most probable prefixes of the factorized distribution
    ``logprobs`` ``[depths, vocab]`` (the paper's heap search)."""
    depths = logprobs.shape[0]
    top = logprobs.topk(min(budget, logprobs.shape[1]), dim=-1)
    lp, tok = top.values.tolist(), top.indices.tolist()
    tree = Tree()
    # (-score, tie counter, parent node, depth index, rank)
    heap = [(-lp[0][0], 0, -1, 0, 0)]
    pushed = 1
    while heap and len(tree.tokens) < budget:
        neg, _, parent, d, rank = heapq.heappop(heap)
        node = len(tree.tokens)
        tree.tokens.append(tok[d][rank])
        tree.parents.append(parent)
        tree.depths.append(d + 1)
        if rank + 1 < len(lp[d]):  # next sibling
            score = -neg - lp[d][rank] + lp[d][rank + 1]
            heapq.heappush(heap, (-score, pushed, parent, d, rank + 1))
            pushed += 1
        if d + 1 < depths:  # first child
            heapq.heappush(heap, (neg - lp[d + 1][0], pushed, node, d + 1, 0))
            pushed += 1
    return tree


class ReferenceDDTree:
    def __init__(
        self, target: str, drafter: str, dtype: torch.dtype, device: str = "cpu"
    ) -> None:
        from transformers import Qwen3ForCausalLM

        self.target = Qwen3ForCausalLM.from_pretrained(target, dtype=dtype)
        self.target.to(device).eval()
        hidden = self.target.config.hidden_size
        self.drafter = DFlashDrafter.load(drafter, hidden).to(device, dtype).eval()
        self.spec = self.drafter.spec
        self.dtype, self.device = dtype, device

    def _tensor(self, data) -> torch.Tensor:
        return torch.tensor(data, device=self.device)

    @torch.no_grad()
    def draft_logprobs(self, committed: list[int], bonus: int) -> torch.Tensor:
        spec = self.spec
        ids = self._tensor([committed])
        hs = self.target.model(input_ids=ids, output_hidden_states=True)
        features = tapped_features(hs.hidden_states, spec.target_layer_ids)
        block = self._tensor([[bonus] + [spec.mask_token_id] * (spec.block_size - 1)])
        embeds = self.target.get_input_embeddings()(block)
        hidden = self.drafter(embeds, features, self._tensor([[len(committed)]]))
        logits = self.target.lm_head(hidden[0, 1:]).float()
        return logits.log_softmax(-1)

    @torch.no_grad()
    def verify(self, committed: list[int], bonus: int, tree: Tree) -> list[int]:
        """Target argmax at the root and at every node (root first)."""
        n, m = len(committed), len(tree.tokens)
        total = n + 1 + m
        allowed = torch.zeros(total, total, dtype=torch.bool)
        allowed[: n + 1, : n + 1] = torch.ones(n + 1, n + 1).tril().bool()
        for i in range(m):
            row = n + 1 + i
            allowed[row, : n + 1] = True
            node = i
            while node >= 0:
                allowed[row, n + 1 + node] = True
                node = tree.parents[node]
        mask = torch.zeros(total, total, dtype=self.dtype)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        mask = mask.to(self.device)
        ids = self._tensor([committed + [bonus] + tree.tokens])
        positions = self._tensor([list(range(n + 1)) + [n + d for d in tree.depths]])
        logits = self.target(
            input_ids=ids, position_ids=positions, attention_mask=mask[None, None]
        ).logits[0, n:]
        return logits.argmax(-1).tolist()

    @torch.no_grad()
    def generate(self, prompt: list[int], max_tokens: int, budget: int):
        """Greedy DDTree; returns (output tokens, accepted drafts per round)."""
        logits = self.target(input_ids=self._tensor([prompt])).logits
        committed, bonus = list(prompt), int(logits[0, -1].argmax())
        out, rounds = [bonus], []
        while len(out) < max_tokens:
            tree = best_first_tree(self.draft_logprobs(committed, bonus), budget)
            choices = self.verify(committed, bonus, tree)
            children = {
                (p, t): i
                for i, (p, t) in enumerate(zip(tree.parents, tree.tokens, strict=True))
            }
            node, accepted = -1, []
            choice = choices[0]
            while (node, choice) in children:
                node = children[(node, choice)]
                accepted.append(choice)
                choice = choices[node + 1]
            committed += [bonus] + accepted
            bonus = choice
            out += accepted + [bonus]
            rounds.append(len(accepted))
        return out[:max_tokens], rounds


@torch.no_grad()
def plain_greedy(target, prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        x = torch.tensor([ids], device=target.device)
        ids.append(int(target(input_ids=x).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def run_vllm_ddtree(args, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.target,
        speculative_config={
            "method": "ddtree",
            "model": args.drafter,
            "num_speculative_tokens": args.budget,
        },
        dtype=args.vllm_dtype,
        max_model_len=args.prompt_len + args.max_tokens + 64,
        max_num_seqs=args.vllm_batch,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        gpu_memory_utilization=0.3,
    )
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True),
        use_tqdm=False,
    )
    counts = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    drafts = counts.get("vllm:spec_decode_num_drafts", 0)
    accepted = counts.get("vllm:spec_decode_num_accepted_tokens", 0)
    llm.llm_engine.engine_core.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], 1 + accepted / max(drafts, 1)


def main(argv: list[str] | None = None) -> None:
    from vllm_ddtree.fixtures import TRAINED_TINY_DIR, trained_pair

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", type=Path, default=TRAINED_TINY_DIR)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", help="reference dtype")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--vllm-batch", type=int, default=1, help="vLLM max_num_seqs")
    ap.add_argument("--parity", action="store_true", help="also run vLLM ddtree")
    ap.add_argument(
        "--check-greedy",
        action="store_true",
        help="also compare with plain HF greedy decoding",
    )
    ap.add_argument("--out", type=Path, help="write a JSON report here")
    args = ap.parse_args(argv)

    pair = trained_pair(args.pair)
    args.target, args.drafter = str(pair.target), str(pair.drafter)
    prompts = [p[-args.prompt_len :] for p in pair.load_prompts()][: args.num_prompts]
    ref = ReferenceDDTree(
        args.target, args.drafter, getattr(torch, args.dtype), args.device
    )

    start = time.perf_counter()
    ref_out, ref_rounds = [], []
    for p in prompts:
        out, rounds = ref.generate(p, args.max_tokens, args.budget)
        ref_out.append(out)
        ref_rounds += rounds
    ref_tau = 1 + sum(ref_rounds) / len(ref_rounds)
    report: dict = {
        "budget": args.budget,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "reference": {
            "dtype": args.dtype,
            "tau": ref_tau,
            "rounds": len(ref_rounds),
            "seconds": time.perf_counter() - start,
        },
    }
    print(f"reference: tau {ref_tau:.3f} over {len(ref_rounds)} rounds", flush=True)
    if args.check_greedy:
        same = sum(
            plain_greedy(ref.target, p, args.max_tokens) == o
            for p, o in zip(prompts, ref_out, strict=True)
        )
        report["reference"]["equal_to_hf_greedy"] = f"{same}/{len(prompts)}"
        print(f"reference == HF greedy: {same}/{len(prompts)}", flush=True)
    if args.parity:
        vllm_out, vllm_tau = run_vllm_ddtree(args, prompts)
        same = sum(a == b for a, b in zip(ref_out, vllm_out, strict=True))
        first_diff = [
            next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None
            )
            for a, b in zip(ref_out, vllm_out, strict=True)
        ]
        rel = abs(vllm_tau - ref_tau) / ref_tau
        report["vllm"] = {
            "dtype": args.vllm_dtype,
            "tau": vllm_tau,
            "identical_outputs": f"{same}/{len(prompts)}",
            "first_divergence": first_diff,
            "tau_rel_diff": rel,
        }
        print(
            f"vllm ddtree: tau {vllm_tau:.3f}; relative tau difference {rel:.2%}; "
            f"identical outputs {same}/{len(prompts)}; first divergence {first_diff}",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
