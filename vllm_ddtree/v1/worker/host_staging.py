# SPDX-License-Identifier: Apache-2.0
"""One non-blocking host-to-device transfer for a step's index arrays.

A verify step needs a dozen small index arrays on the device (tree layout,
logit rows, commit rows) that the host computes from the scheduler's output.
``torch.from_numpy(a).to(device)`` copies from pageable memory and
synchronises the stream, so each such copy made while the GPU is busy makes
the host wait for the GPU, and the GPU then idles while the host prepares the
rest of the step. :class:`HostStaging` packs all of a step's arrays into one
pinned buffer and sends it in one non-blocking copy, made before the forward
pass, whose results every later phase (sampler, commit) reuses. Each array
starts on a 16-byte boundary of that buffer, as a fresh allocation would:
Triton specialises kernels on their pointers' 16-byte alignment, so a view at
an odd int64 offset would compile (mid-serving) a second, slower variant of a
kernel the start-up warm-up compiled with aligned dummies.
"""

from __future__ import annotations

import numpy as np
import torch

# Elements of int64 in 16 bytes.
_ALIGN = 2


class HostStaging:
    """Uploads groups of integer arrays as int64 device tensors.

    A pinned buffer can be rewritten only once the copy that last read it
    has left it. Under async scheduling no step ends with a sync, and the
    previous upload's copy may still be queued behind the GPU's last step,
    so one buffer would make a step whose layout changed wait for the GPU.
    ``slots`` buffers are used in turn instead: the copy that last read the
    next one was made ``slots`` uploads ago.
    """

    def __init__(self, device: torch.device | str, slots: int = 4) -> None:
        self.device = torch.device(device)
        self._host: list[torch.Tensor | None] = [None] * slots
        self._sent: list[torch.cuda.Event | None] = [None] * slots
        self._slot = 0

    def upload(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """int64 device tensors with the shapes and values of ``arrays``
        (integers or booleans). The copy is asynchronous on a GPU; on a CPU
        the results are fresh tensors, never views of the staging buffer."""
        sizes = [a.size for a in arrays]
        padded = [-(-size // _ALIGN) * _ALIGN for size in sizes]
        total = sum(padded)
        on_gpu = self.device.type == "cuda"
        slot = self._slot
        self._slot = (slot + 1) % len(self._host)
        sent = self._sent[slot]
        if sent is not None:
            sent.synchronize()
        buffer = self._host[slot]
        capacity = 0 if buffer is None else buffer.numel()
        if buffer is None or capacity < total:
            size = max(total, 1024, 2 * capacity)
            buffer = torch.empty(size, dtype=torch.int64, pin_memory=on_gpu)
            self._host[slot] = buffer
        host = buffer.numpy()
        lo = 0
        for array, size, span in zip(arrays, sizes, padded, strict=True):
            host[lo : lo + size] = array.ravel()
            lo += span
        staged = buffer[:total]
        if on_gpu:
            flat = staged.to(self.device, non_blocking=True)
            self._sent[slot] = torch.cuda.Event()
            self._sent[slot].record()
        else:
            flat = staged.clone()
        # One split into every array and its padding (one host call, not a
        # slice per array: a mixed step stages some fifteen arrays).
        spans = [
            n
            for size, span in zip(sizes, padded, strict=True)
            for n in (size, span - size)
        ]
        return [
            part if array.ndim == 1 else part.view(array.shape)
            for array, part in zip(
                arrays, flat.split_with_sizes(spans)[::2], strict=True
            )
        ]
