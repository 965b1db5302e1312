# SPDX-License-Identifier: Apache-2.0
"""The accepted-path KV commit of every attention layer in two launches.

After the walk, each request's accepted nodes move to the cache slots right
after its context: ``rows[dst[i]] = rows[src[i]]`` in every layer, the slots
looked up in the step's slot mapping inside the kernel. Done per
layer, that is a gather and a scatter for each of the (e.g. 36) layers, every
step. Here the layers' slot-row views (a slot's keys and values side by side,
vLLM's FlashAttention NHD cache) are addressed through a table of base
pointers: one launch gathers the source rows of all layers into a scratch
buffer, a second scatters them to the destinations. Reading every source
before writing any destination keeps overlapping moves correct.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_rows"])
def _move_rows_kernel(
    LAYER_ROWS,  # [L] int64: base address of each layer's [slots, width] rows
    SLOT_MAPPING,  # [tokens]: each batch token's cache slot
    SRC,  # [num_rows]: batch token whose row moves ...
    DST,  # [num_rows]: ... to this token's slot
    SCRATCH,  # [L, num_rows, width]
    num_rows,
    width,
    row_stride,
    BLOCK: tl.constexpr,
    TO_SCRATCH: tl.constexpr,
):
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    src = tl.load(SLOT_MAPPING + tl.load(SRC + i)).to(tl.int64)
    dst = tl.load(SLOT_MAPPING + tl.load(DST + i)).to(tl.int64)
    # A row that stays is no other move's destination (the moves permute).
    keep = (cols < width) & (src != dst)
    rows = tl.load(LAYER_ROWS + layer).to(tl.pointer_type(SCRATCH.dtype.element_ty))
    scratch = SCRATCH + (layer * num_rows + i) * width + cols
    if TO_SCRATCH:
        tl.store(scratch, tl.load(rows + src * row_stride + cols, mask=keep), mask=keep)
    else:
        tl.store(rows + dst * row_stride + cols, tl.load(scratch, mask=keep), mask=keep)


def address_table(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``[len(tensors)]`` int64 device table of the tensors' base addresses
    (the caller keeps the tensors alive)."""
    return torch.tensor(
        [t.data_ptr() for t in tensors], dtype=torch.int64, device=tensors[0].device
    )


class SlotRowsCommit:
    """``rows[dst] = rows[src]`` in the slot-row views of many layers.

    Built once per KV-cache group (:meth:`for_rows`) from views that share
    shape, strides, dtype and device (the layers of one group do); it keeps
    the views alive and their base addresses in a device table.
    """

    @classmethod
    def for_rows(cls, layer_rows: list[torch.Tensor]) -> SlotRowsCommit | None:
        """The commit of ``layer_rows``, or ``None`` when they do not share
        one geometry of contiguous rows."""
        geometries = {(r.shape, r.stride(), r.dtype, r.device) for r in layer_rows}
        if len(geometries) != 1 or layer_rows[0].stride(1) != 1:
            return None
        return cls(layer_rows)

    def __init__(self, layer_rows: list[torch.Tensor]) -> None:
        first = layer_rows[0]
        self.layer_rows = layer_rows
        self.table = address_table(layer_rows)
        self.width = first.shape[1]
        self.row_stride = first.stride(0)
        self.block = min(triton.next_power_of_2(self.width), 4096)

    def __call__(
        self, slot_mapping: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        """Move the row of batch token ``src[i]``'s slot to ``dst[i]``'s
        (``slot_mapping``: the step's slot of every batch token). The moves
        must permute their slots, as a commit's do."""
        num_rows = src.numel()
        if num_rows == 0:
            return
        first = self.layer_rows[0]
        scratch = torch.empty(
            (len(self.layer_rows), num_rows, self.width),
            dtype=first.dtype,
            device=first.device,
        )
        grid = (num_rows, len(self.layer_rows), triton.cdiv(self.width, self.block))
        for to_scratch in (True, False):
            _move_rows_kernel[grid](
                self.table,
                slot_mapping,
                src,
                dst,
                scratch,
                num_rows,
                self.width,
                self.row_stride,
                BLOCK=self.block,
                TO_SCRATCH=to_scratch,
            )
