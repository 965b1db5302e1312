# SPDX-License-Identifier: Apache-2.0
"""Deterministic tiny fixture models for tests (no network access needed).

Builds, on first use, a small byte-level BPE tokenizer and four tiny
checkpoints that vLLM can load:

* ``dense-target``   -- ``Qwen3ForCausalLM`` (4 layers, hidden 128)
* ``dense-dflash``   -- a ``DFlashDraftModel`` drafter for it (1 layer)
* ``hybrid-target``  -- ``Qwen3NextForCausalLM`` (3 GDN + 1 full-attention
  layer, MoE MLPs)
* ``hybrid-dflash``  -- a ``DFlashDraftModel`` drafter for it

The directory is cached (default ``$VLLM_DDTREE_FIXTURES`` or
``<repo>/.fixtures``) and rebuilt when it is missing or when the generator
changed (the stamp file holds a hash of this source file).  A build is
written into a temporary sibling directory and renamed into place under a
file lock, so a half-written directory is never visible.

Weights are seeded noise on top of a small hand-made structure, so that
greedy decoding is context dependent yet has large logit margins (robust to
bf16 / kernel / batch-shape numeric differences), and so that the drafters
get a realistic, partial acceptance rate:

* Token embeddings ``E[t] = r_t + beta*u + beta*c_t*w`` with fixed orthonormal
  ``u, w``, random ``r_t ⟂ u, w`` and a random class ``c_t = +-1``.  The DFlash
  mask token instead carries ``-beta*u``.
* ``lm_head`` row ``pi(t)`` is ``r_t / |r_t|`` for a fixed random cyclic
  permutation ``pi`` of the ordinary tokens (one long cycle, so greedy output
  never falls into a short loop); special tokens and vocab padding get
  ``-u`` rows and are never predicted.
* One attention layer of each target (dense: layer 0, hybrid: the full
  attention layer 3) has, per kv group, a head whose q/k read only the u/w
  components; after the per-head RMSNorm they are exact constant patterns,
  so (through RoPE) the head attends, with a very sharp softmax, to the
  previous token if ``c_cur = +1`` and to the current token otherwise, and
  adds a scaled copy of that token's normalised residual to the stream.  The
  target therefore follows the rule ``next = pi(prev) if c_cur > 0 else
  pi(cur)``, i.e. its output depends on the KV cache.  All other weights
  (attention heads, MLPs, GDN, MoE) are scaled random noise that perturbs
  logprobs but not the greedy choice.
* The drafter (one non-causal layer, ``fc = 0`` so the context K/V are zero)
  lets every masked query attend to the block's first (real) token and copies
  its normalised embedding; via the shared target ``lm_head`` it proposes
  ``pi(last token)`` at every position.  Stock DFlash thus accepts roughly
  two thirds of first drafts and a third of second drafts (when the target
  repeats a token), and never later ones.

Usage::

    from vllm_ddtree.fixtures import fixture_paths
    paths = fixture_paths()          # builds on first use
    paths.dense_target, paths.dense_drafter, ...

    python -m vllm_ddtree.fixtures [--out DIR] [--force]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import tempfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

# Bump to force a rebuild even if this file's bytes are unchanged.
FIXTURE_VERSION = 1
_STAMP_FILE = "FIXTURE_STAMP"
_ENV_DIR = "VLLM_DDTREE_FIXTURES"

# Tokenizer
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END, MASK_TOKEN)
TOKENIZER_VOCAB = 384  # 256 byte tokens + 4 specials + 124 merges

# Shared model geometry
HIDDEN = 128
NUM_LAYERS = 4
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 64
MAX_POS = 4096
DENSE_INTERMEDIATE = 128
# The drafter uses plain multi-head attention whose value heads exactly cover
# the hidden size (needed by the embedding-copy construction below).
DRAFT_HEADS = HIDDEN // HEAD_DIM
DRAFT_INTERMEDIATE = 128
DENSE_ROPE_THETA = 1_000_000.0
HYBRID_ROPE_THETA = 10_000.0
HYBRID_PARTIAL_ROTARY = 0.25
DFLASH_BLOCK_SIZE = 16
TARGET_LAYER_IDS = (1, 2)

# Structure parameters (see module docstring)
_SEED = 1234
_BETA = 4.0  # size of the u / w marker components of the embeddings
_LM_SCALE = 1.0  # logit scale of the lm_head
# std multipliers (x 1/sqrt(fan_in)) of the random output projections
_DENSE_NOISE_GAIN = 1.0
_HYBRID_NOISE_GAIN = 0.5
_COPY_GAIN = 3.0  # o_proj gain of the target's previous/current-token copy
_POS_QK_GAIN = 5.0  # q_norm/k_norm weight of the target's positional heads
_DRAFT_QK_GAIN = 2.5  # q_norm/k_norm weight on the drafter's matching slot
_DRAFT_COPY_GAIN = 8.0  # o_proj gain of the drafter's copied embedding

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
The little harbour town woke slowly in the grey light of the morning. Fishing
boats rocked against the stone quay while gulls argued over the remains of the
night's catch. An old man in a blue coat walked along the water, counting the
boats as he always did, and nodding to the baker who was already sweeping the
step in front of her shop. The smell of fresh bread drifted down the narrow
street and mixed with the salt of the sea.

In the school on the hill the children learned to read and write, to add and
subtract, and to name the rivers and mountains of the world. Their teacher
believed that every question deserved an answer, and that the best answers
usually led to better questions. She kept a jar of coloured pencils on her
desk and a map of the stars on the wall behind it.

A computer is a machine that follows instructions. A program is a list of such
instructions, written so that both people and machines can understand them.
Good programs are simple, correct, and fast; great programs are also easy to
change. When a program runs, it reads input, does some work, and writes
output. Testing a program means running it on many inputs and checking that
the output is what we expect.

Language models predict the next word of a text from the words that came
before it. A small model can be fast but makes more mistakes; a large model is
slower but more accurate. Speculative decoding lets a small draft model guess
several words ahead, and the large model checks all of the guesses at once,
keeping the longest prefix that it agrees with. The result is the same text,
produced in less time.

What is the capital of France? Paris is the capital of France. How many days
are in a week? There are seven days in a week. Please write a short story
about a cat who wanted to fly. Once upon a time there was a cat named Milo who
watched the birds every day from the window and dreamed of the open sky.
"""


@dataclass(frozen=True)
class FixturePaths:
    root: Path
    dense_target: Path
    dense_drafter: Path
    hybrid_target: Path
    hybrid_drafter: Path
    tokenizer: Path


@dataclass(frozen=True)
class TrainedPair:
    """A trained target + DFlash drafter (``vllm_ddtree.training``)."""

    root: Path
    target: Path
    drafter: Path
    prompts: Path  # jsonl: {"prompt_token_ids": [...], "text": ...} per line

    def load_prompts(self) -> list[list[int]]:
        with open(self.prompts) as fh:
            return [json.loads(line)["prompt_token_ids"] for line in fh]


# Committed pair with real acceptance (``--preset tiny``, about 7 MB).
TRAINED_TINY_DIR = Path(__file__).resolve().parent / "assets" / "trained-tiny"


def trained_pair(root: Path | str = TRAINED_TINY_DIR) -> TrainedPair:
    """The pair written by ``python -m vllm_ddtree.training.train_pair``."""
    root = Path(root)
    pair = TrainedPair(root, root / "target", root / "dflash", root / "prompts.jsonl")
    if not (pair.target / "config.json").is_file():
        raise FileNotFoundError(f"no trained pair under {root}")
    return pair


def default_fixture_dir() -> Path:
    env = os.environ.get(_ENV_DIR)
    if env:
        return Path(env).expanduser().resolve()
    return Path(__file__).resolve().parents[1] / ".fixtures"


def _paths(root: Path) -> FixturePaths:
    return FixturePaths(
        root=root,
        dense_target=root / "dense-target",
        dense_drafter=root / "dense-dflash",
        hybrid_target=root / "hybrid-target",
        hybrid_drafter=root / "hybrid-dflash",
        tokenizer=root / "tokenizer",
    )


# Hash of the generator as imported (not as it is on disk now), so that a
# process running older code never stamps its output as current.
_SOURCE_HASH = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def fixture_stamp() -> str:
    return f"v{FIXTURE_VERSION}-{_SOURCE_HASH}"


def _is_current(root: Path) -> bool:
    stamp = root / _STAMP_FILE
    return stamp.is_file() and stamp.read_text().strip() == fixture_stamp()


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def fixture_paths(root: Path | str | None = None, force: bool = False) -> FixturePaths:
    """Return the fixture directories, building them first if needed."""
    root = Path(root).expanduser().resolve() if root else default_fixture_dir()
    if not force and _is_current(root):
        return _paths(root)
    key = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    with _locked(Path(tempfile.gettempdir()) / f"vllm_ddtree_fixtures_{key}.lock"):
        if force or not _is_current(root):
            root.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
            try:
                tmp.chmod(0o755)
                build_fixtures(tmp)
                (tmp / _STAMP_FILE).write_text(fixture_stamp() + "\n")
                if root.exists():
                    old = root.parent / f".{root.name}.old-{os.getpid()}"
                    os.rename(root, old)
                    shutil.rmtree(old, ignore_errors=True)
                os.rename(tmp, root)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
    return _paths(root)


# ----------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------


def build_tokenizer(
    lines: Iterable[str] | None = None,
    vocab_size: int = TOKENIZER_VOCAB,
    max_length: int = MAX_POS,
):
    """Train a byte-level BPE tokenizer (default: the tiny built-in corpus).

    ``lines`` must be a deterministic iterable for the result to be
    reproducible; the trainer itself is deterministic.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if lines is None:
        lines = _CORPUS.splitlines(keepends=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        chat_template=_CHAT_TEMPLATE,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


# ----------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------


def _gen(name: str) -> torch.Generator:
    """A generator seeded from the tensor name (order independent)."""
    return torch.Generator().manual_seed(_SEED * 1_000_003 + zlib.crc32(name.encode()))


def _randn(name: str, *shape: int, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(name)) * std


def _dense(name: str, out_f: int, in_f: int, gain: float):
    return _randn(name, out_f, in_f, std=gain / in_f**0.5)


@dataclass(frozen=True)
class _Shared:
    """Embedding / lm_head structure shared by a target and its drafter."""

    u: torch.Tensor  # [H] unit: "real token" marker (+beta), mask token: -beta
    w: torch.Tensor  # [H] unit, u ⟂ w: token class marker (+-beta)
    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]


def _shared_structure(tag: str, vocab: int, special_ids, mask_id) -> _Shared:
    g = _gen(f"{tag}.structure")
    uw, _ = torch.linalg.qr(torch.randn(HIDDEN, 2, generator=g))
    u, w = uw[:, 0].contiguous(), uw[:, 1].contiguous()
    r = torch.randn(vocab, HIDDEN, generator=g)
    r = r - (r @ u)[:, None] * u - (r @ w)[:, None] * w  # r_t ⟂ u, w
    cls = torch.randint(0, 2, (vocab,), generator=g).float() * 2 - 1
    regular = [t for t in range(vocab) if t not in special_ids]
    # pi is one long cycle through all ordinary tokens, so greedy outputs never
    # fall into a short loop: order[i] -> order[i + 1].
    order = [regular[i] for i in torch.randperm(len(regular), generator=g).tolist()]
    embed = r + _BETA * u + _BETA * cls[:, None] * w
    embed[mask_id] = r[mask_id] - _BETA * u
    r_hat = r / r.norm(dim=-1, keepdim=True)
    lm_head = torch.empty(vocab, HIDDEN)
    # Row pi(t) = scale * r_hat[t]: a residual stream ~ r_t predicts pi(t).
    for i, src in enumerate(order):
        lm_head[order[(i + 1) % len(order)]] = _LM_SCALE * r_hat[src]
    for t in special_ids:  # never predicted (the residual has a +u component)
        lm_head[t] = -2.0 * _LM_SCALE * u
    return _Shared(u, w, embed, lm_head)


def _pos_pattern(rot_dim: int, theta: float, n_pairs: int, shift: int):
    """Per-head q/k pattern whose RoPE'd dot product with the unshifted pattern
    peaks sharply at relative position ``shift`` (neox rotary layout)."""
    half = rot_dim // 2
    pat = torch.zeros(HEAD_DIM, dtype=torch.float64)
    for i in range(n_pairs):
        freq = theta ** (-2.0 * i / rot_dim)
        pat[i] = math.cos(freq * shift)
        pat[i + half] = -math.sin(freq * shift)
    return pat.float()


def _copy_attention(
    w: dict,
    p: str,
    sh: _Shared,
    *,
    rot_dim: int,
    theta: float,
    n_pairs: int,
    gated: bool,
    zero_centered_norm: bool,
    gain: float,
) -> None:
    """Attention whose first q head of each kv group copies the normalised
    residual of the previous token (class +1) or of the token itself (class
    -1) into the residual stream; the other q heads are random noise.

    q and k of the structured heads only read the u/w components, so after the
    per-head RMSNorm they are exact constant patterns and the attention target
    is chosen purely by relative position (via RoPE) and the token class.
    """
    group = NUM_HEADS // NUM_KV_HEADS
    p0 = _pos_pattern(rot_dim, theta, n_pairs, 0)
    p1 = _pos_pattern(rot_dim, theta, n_pairs, 1)
    qa, qb = (p1 + p0) / 2, (p1 - p0) / 2  # q = qa*(u.x) + qb*(w.x) -> p1 | p0
    q_rows, o = [], torch.zeros(HIDDEN, NUM_HEADS * HEAD_DIM)
    k = torch.zeros(NUM_KV_HEADS * HEAD_DIM, HIDDEN)
    v = torch.zeros(NUM_KV_HEADS * HEAD_DIM, HIDDEN)
    for kvh in range(NUM_KV_HEADS):
        k[kvh * HEAD_DIM : (kvh + 1) * HEAD_DIM] = torch.outer(p0, sh.u)
        for d in range(HEAD_DIM):  # kv head g copies hidden dims [64g, 64g+64)
            v[kvh * HEAD_DIM + d, (kvh * HEAD_DIM + d) % HIDDEN] = 1.0
    for h in range(NUM_HEADS):
        cols = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)
        if h % group == 0:
            kvh = h // group
            q_rows.append(torch.outer(qa, sh.u) + torch.outer(qb, sh.w))
            gate = torch.outer(torch.full((HEAD_DIM,), 5.0), sh.u)
            rows = slice(kvh * HEAD_DIM, (kvh + 1) * HEAD_DIM)
            o[rows, cols] = _COPY_GAIN * torch.eye(HEAD_DIM)
        else:
            q_rows.append(_dense(f"{p}.q_proj.{h}", HEAD_DIM, HIDDEN, gain=1.0))
            gate = _dense(f"{p}.gate.{h}", HEAD_DIM, HIDDEN, gain=1.0)
            o[:, cols] = _dense(f"{p}.o_proj.{h}", HIDDEN, HEAD_DIM, gain=gain)
        if gated:  # Qwen3-Next layout: per head [q (head_dim), gate (head_dim)]
            q_rows.append(gate)
    w[f"{p}.q_proj.weight"] = torch.cat(q_rows)
    w[f"{p}.k_proj.weight"] = k
    w[f"{p}.v_proj.weight"] = v
    w[f"{p}.o_proj.weight"] = o
    norm = torch.full((HEAD_DIM,), _POS_QK_GAIN - (1.0 if zero_centered_norm else 0))
    w[f"{p}.q_norm.weight"] = norm
    w[f"{p}.k_norm.weight"] = norm.clone()


def _random_attention(w: dict, p: str, gain: float) -> None:
    q_out = NUM_HEADS * HEAD_DIM
    kv_out = NUM_KV_HEADS * HEAD_DIM
    w[f"{p}.q_proj.weight"] = _dense(f"{p}.q_proj", q_out, HIDDEN, gain=1.0)
    w[f"{p}.k_proj.weight"] = _dense(f"{p}.k_proj", kv_out, HIDDEN, gain=1.0)
    w[f"{p}.v_proj.weight"] = _dense(f"{p}.v_proj", kv_out, HIDDEN, gain=1.0)
    w[f"{p}.o_proj.weight"] = _dense(f"{p}.o_proj", HIDDEN, q_out, gain=gain)
    w[f"{p}.q_norm.weight"] = torch.ones(HEAD_DIM)
    w[f"{p}.k_norm.weight"] = torch.ones(HEAD_DIM)


def _mlp(p: str, w: dict, inter: int, gain: float, seed: str = ""):
    """SwiGLU MLP ``p.{gate,up,down}_proj``; ``seed`` prefixes the RNG names."""
    s = seed + p
    w[f"{p}.gate_proj.weight"] = _dense(f"{s}.gate_proj", inter, HIDDEN, gain=1.0)
    w[f"{p}.up_proj.weight"] = _dense(f"{s}.up_proj", inter, HIDDEN, gain=1.0)
    w[f"{p}.down_proj.weight"] = _dense(f"{s}.down_proj", HIDDEN, inter, gain=gain)


def dense_target_weights(sh: _Shared) -> dict[str, torch.Tensor]:
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": sh.embed,
        "lm_head.weight": sh.lm_head,
        "model.norm.weight": torch.ones(HIDDEN),
    }
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}"
        if i == 0:
            _copy_attention(
                w,
                f"{p}.self_attn",
                sh,
                rot_dim=HEAD_DIM,
                theta=DENSE_ROPE_THETA,
                n_pairs=8,
                gated=False,
                zero_centered_norm=False,
                gain=_DENSE_NOISE_GAIN,
            )
        else:
            _random_attention(w, f"{p}.self_attn", _DENSE_NOISE_GAIN)
        _mlp(f"{p}.mlp", w, DENSE_INTERMEDIATE, _DENSE_NOISE_GAIN)
        w[f"{p}.input_layernorm.weight"] = torch.ones(HIDDEN)
        w[f"{p}.post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    return w


_GDN = dict(k_heads=2, v_heads=4, k_dim=32, v_dim=32, conv=4)
_MOE = dict(experts=4, top_k=2, inter=32, shared_inter=32)


def hybrid_layer_types() -> list[str]:
    return ["linear_attention"] * (NUM_LAYERS - 1) + ["full_attention"]


def hybrid_target_weights(sh: _Shared) -> dict[str, torch.Tensor]:
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": sh.embed,
        "lm_head.weight": sh.lm_head,
        "model.norm.weight": torch.zeros(HIDDEN),  # zero-centred: scale 1 + w
    }
    kd = _GDN["k_heads"] * _GDN["k_dim"]
    vd = _GDN["v_heads"] * _GDN["v_dim"]
    g = _HYBRID_NOISE_GAIN
    for i, kind in enumerate(hybrid_layer_types()):
        p = f"model.layers.{i}"
        if kind == "linear_attention":
            a = f"{p}.linear_attn"
            w[f"{a}.in_proj_qkvz.weight"] = _dense(
                f"{a}.in_proj_qkvz", 2 * kd + 2 * vd, HIDDEN, gain=1.0
            )
            w[f"{a}.in_proj_ba.weight"] = _dense(
                f"{a}.in_proj_ba", 2 * _GDN["v_heads"], HIDDEN, gain=1.0
            )
            w[f"{a}.conv1d.weight"] = _randn(
                f"{a}.conv1d", 2 * kd + vd, 1, _GDN["conv"], std=0.5
            )
            w[f"{a}.dt_bias"] = torch.ones(_GDN["v_heads"])
            a_init = 1.0 + 7.0 * torch.rand(_GDN["v_heads"], generator=_gen(a + ".A"))
            w[f"{a}.A_log"] = a_init.log()
            w[f"{a}.norm.weight"] = torch.ones(_GDN["v_dim"])
            w[f"{a}.out_proj.weight"] = _dense(f"{a}.out_proj", HIDDEN, vd, gain=g)
        else:
            _copy_attention(
                w,
                f"{p}.self_attn",
                sh,
                rot_dim=int(HEAD_DIM * HYBRID_PARTIAL_ROTARY),
                theta=HYBRID_ROPE_THETA,
                n_pairs=6,
                gated=True,
                zero_centered_norm=True,
                gain=g,
            )
        m = f"{p}.mlp"
        w[f"{m}.gate.weight"] = _dense(f"{m}.gate", _MOE["experts"], HIDDEN, 1.0)
        for e in range(_MOE["experts"]):
            _mlp(f"{m}.experts.{e}", w, _MOE["inter"], g)
        _mlp(f"{m}.shared_expert", w, _MOE["shared_inter"], g)
        w[f"{m}.shared_expert_gate.weight"] = _dense(
            f"{m}.shared_expert_gate", 1, HIDDEN, gain=1.0
        )
        w[f"{p}.input_layernorm.weight"] = torch.zeros(HIDDEN)
        w[f"{p}.post_attention_layernorm.weight"] = torch.zeros(HIDDEN)
    return w


# Drafter: slot inside each head used for "real token vs mask" matching.  The
# last pair of the rotary half has the lowest RoPE frequency, so the matching
# score is (almost) independent of relative position.
_SLOT = HEAD_DIM // 2 - 1


def drafter_weights(sh: _Shared, tag: str) -> dict[str, torch.Tensor]:
    """Weights in the checkpoint naming vLLM's DFlash loader expects."""
    p = "layers.0.self_attn"
    assert DRAFT_HEADS * HEAD_DIM == HIDDEN
    # Each head's q and k read only the u component, into one slot; after the
    # per-head RMSNorm that slot is +-sqrt(HEAD_DIM) (sign of u . x), and it
    # is 0 for the all-zero context states.
    q = torch.zeros(HIDDEN, HIDDEN)
    k = torch.zeros(HIDDEN, HIDDEN)
    for h in range(DRAFT_HEADS):
        q[h * HEAD_DIM + _SLOT] = -sh.u  # > 0 for the mask token, < 0 otherwise
        k[h * HEAD_DIM + _SLOT] = sh.u  # > 0 for real tokens
    qk_norm = torch.ones(HEAD_DIM)
    qk_norm[_SLOT] = _DRAFT_QK_GAIN
    w = {
        f"{p}.q_proj.weight": q,
        f"{p}.k_proj.weight": k,
        # v copies the normalised input; o_proj adds it (scaled) to the residual
        f"{p}.v_proj.weight": torch.eye(HIDDEN),
        f"{p}.o_proj.weight": _DRAFT_COPY_GAIN * torch.eye(HIDDEN),
        f"{p}.q_norm.weight": qk_norm,
        f"{p}.k_norm.weight": qk_norm.clone(),
        "layers.0.input_layernorm.weight": torch.ones(HIDDEN),
        "layers.0.post_attention_layernorm.weight": torch.ones(HIDDEN),
        # fc == 0: context states are zero, so context K/V are exactly zero.
        "fc.weight": torch.zeros(HIDDEN, len(TARGET_LAYER_IDS) * HIDDEN),
        "hidden_norm.weight": torch.ones(HIDDEN),
        "norm.weight": torch.ones(HIDDEN),
    }
    _mlp("layers.0.mlp", w, DRAFT_INTERMEDIATE, gain=0.1, seed=f"{tag}-dflash.")
    return w


# ----------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------


def _common_cfg(tok, heads: int = NUM_HEADS, kv_heads: int = NUM_KV_HEADS) -> dict:
    return dict(
        hidden_size=HIDDEN,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="bfloat16",
    )


def dense_target_config(tok, vocab: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=vocab,
        num_hidden_layers=NUM_LAYERS,
        intermediate_size=DENSE_INTERMEDIATE,
        rope_parameters={"rope_type": "default", "rope_theta": DENSE_ROPE_THETA},
        **_common_cfg(tok),
    )


def hybrid_target_config(tok, vocab: int):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        architectures=["Qwen3NextForCausalLM"],
        vocab_size=vocab,
        num_hidden_layers=NUM_LAYERS,
        layer_types=hybrid_layer_types(),
        full_attention_interval=NUM_LAYERS,
        intermediate_size=DENSE_INTERMEDIATE,
        linear_num_key_heads=_GDN["k_heads"],
        linear_num_value_heads=_GDN["v_heads"],
        linear_key_head_dim=_GDN["k_dim"],
        linear_value_head_dim=_GDN["v_dim"],
        linear_conv_kernel_dim=_GDN["conv"],
        num_experts=_MOE["experts"],
        num_experts_per_tok=_MOE["top_k"],
        moe_intermediate_size=_MOE["inter"],
        shared_expert_intermediate_size=_MOE["shared_inter"],
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": HYBRID_ROPE_THETA,
            "partial_rotary_factor": HYBRID_PARTIAL_ROTARY,
        },
        **_common_cfg(tok),
    )


def drafter_config(tok, vocab: int, mask_id: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        architectures=["DFlashDraftModel"],
        vocab_size=vocab,
        num_hidden_layers=1,
        intermediate_size=DRAFT_INTERMEDIATE,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        block_size=DFLASH_BLOCK_SIZE,
        num_target_layers=NUM_LAYERS,
        dflash_config={
            "mask_token_id": mask_id,
            "target_layer_ids": list(TARGET_LAYER_IDS),
        },
        **_common_cfg(tok, heads=DRAFT_HEADS, kv_heads=DRAFT_HEADS),
    )


# ----------------------------------------------------------------------------
# Build
# ----------------------------------------------------------------------------


def save_model(out: Path, config, weights: dict[str, torch.Tensor], tok) -> None:
    """Write ``config``, ``weights`` (as bf16 safetensors) and ``tok`` into
    the new directory ``out``: the layout vLLM and transformers load."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    config.save_pretrained(out)
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in sorted(weights.items())}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    tok.save_pretrained(out)


def build_fixtures(out: Path | str) -> FixturePaths:
    """Write all fixtures into ``out`` (no caching, no stamp)."""
    out = Path(out)
    paths = _paths(out)
    tok = build_tokenizer()
    tok.save_pretrained(paths.tokenizer)
    n_tok = len(tok)
    vocab = -(-n_tok // 64) * 64
    mask_id = tok.convert_tokens_to_ids(MASK_TOKEN)
    special = sorted(
        {tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
        | set(range(n_tok, vocab))
    )
    for tag, target_dir, draft_dir in (
        ("dense", paths.dense_target, paths.dense_drafter),
        ("hybrid", paths.hybrid_target, paths.hybrid_drafter),
    ):
        shared = _shared_structure(tag, vocab, special, mask_id)
        if tag == "dense":
            cfg = dense_target_config(tok, vocab)
            weights = dense_target_weights(shared)
        else:
            cfg = hybrid_target_config(tok, vocab)
            weights = hybrid_target_weights(shared)
        save_model(target_dir, cfg, weights, tok)
        dcfg = drafter_config(tok, vocab, mask_id)
        save_model(draft_dir, dcfg, drafter_weights(shared, tag), tok)
    (out / "README.json").write_text(
        json.dumps(
            {
                "generator": "vllm_ddtree.fixtures",
                "stamp": fixture_stamp(),
                "tokenizer_size": n_tok,
                "vocab_size": vocab,
                "mask_token_id": mask_id,
                "eos_token_id": tok.eos_token_id,
            },
            indent=2,
        )
        + "\n"
    )
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="fixture directory")
    ap.add_argument("--force", action="store_true", help="rebuild even if current")
    args = ap.parse_args(argv)
    paths = fixture_paths(args.out, force=args.force)
    for field in ("dense_target", "dense_drafter", "hybrid_target", "hybrid_drafter"):
        print(f"{field}: {getattr(paths, field)}")
    print(f"tokenizer: {paths.tokenizer}")


if __name__ == "__main__":
    main()
