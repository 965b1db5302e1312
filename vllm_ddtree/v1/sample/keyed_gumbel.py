# SPDX-License-Identifier: Apache-2.0
"""Gumbel-max sampling keyed by (request seed, position), on any device.

DDTree draws every sample as vLLM's V2 runner does: the argmax of the
processed logits plus Gumbel noise that is a function of the request's
seed, the position of the token whose logits are sampled, and the token id
only. A seeded request then gets the same tokens whatever the tree, the
budget, the batch or the number of accepted drafts, and on a GPU the same
tokens as vLLM's V2 runner without speculation.

On a GPU the noise is vLLM's own (``gumbel_sample``, Philox in Triton). vLLM
has no such op for the CPU, so there the uniform draws come from a
counter-based hash (MurmurHash3's 64-bit finaliser, in wrapping int64 torch
arithmetic): other numbers than the GPU's, with the same keying.
"""

from __future__ import annotations

import torch

# MurmurHash3 fmix64 multipliers and the golden-ratio increment, as the
# signed int64 values of their 64-bit patterns (torch has no uint64 math).
_FMIX_1 = 0xFF51AFD7ED558CCD - 2**64
_FMIX_2 = 0xC4CEB9FE1A85EC53 - 2**64
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is
    arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _fmix64(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shift_right(x, 33)
    x = x * _FMIX_1
    x = x ^ _shift_right(x, 33)
    x = x * _FMIX_2
    return x ^ _shift_right(x, 33)


def keyed_uniform(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Uniform draws in the open interval (0, 1), float64 ``[rows, vocab]``:
    entry ``(i, t)`` depends only on ``(seeds[i], positions[i], t)``."""
    row_key = _fmix64(seeds.long() + _fmix64(positions.long() * _GOLDEN))
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    bits = _fmix64(row_key[:, None] + tokens * _GOLDEN)
    # The top 53 bits, centred in their interval: never exactly 0 or 1.
    return (_shift_right(bits, 11).double() + 0.5) * 2.0**-53


def scale_by_temperature(
    logits: torch.Tensor, row_req: torch.Tensor, temperature: torch.Tensor
) -> torch.Tensor:
    """A float32 copy of ``logits`` with row ``i`` divided by
    ``temperature[row_req[i]]`` (rows at 0, greedy, unchanged). On a GPU the
    division is vLLM's V2 sampler's Triton op, whose rounding can differ from
    torch's in the last bit; keyed samples must match V2's bit for bit."""
    scaled = logits.float().clone()
    if scaled.is_cuda:
        from vllm.v1.worker.gpu.sample.gumbel import apply_temperature

        apply_temperature(scaled, row_req, temperature)
        return scaled
    row_temperature = temperature[row_req]
    return scaled / torch.where(row_temperature == 0, 1.0, row_temperature)[:, None]


def keyed_gumbel_sample(
    logits: torch.Tensor,
    row_req: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    use_fp64: bool,
) -> torch.Tensor:
    """Token per row of already processed ``logits`` (temperature, top-k,
    top-p applied): the argmax of the logits plus the noise of
    ``(seeds[row_req[i]], positions[i])``; rows whose request's
    ``temperature`` is 0 (greedy) get no noise. ``use_fp64`` is vLLM's
    Gumbel precision switch (the CPU path always works in float64)."""
    if logits.is_cuda:
        # Imported here: vLLM's V2 sampling ops are Triton (GPU) code.
        from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

        return gumbel_sample(
            logits,
            row_req,
            temperature,
            seeds,
            positions,
            apply_temperature=False,
            use_fp64=use_fp64,
        )
    u = keyed_uniform(seeds[row_req], positions, logits.shape[-1])
    noisy = logits.double() - torch.log(-torch.log(u))
    sampled = noisy.argmax(dim=-1)
    return torch.where(temperature[row_req] == 0, logits.argmax(dim=-1), sampled)
