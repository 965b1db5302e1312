# SPDX-License-Identifier: Apache-2.0
"""The accepted-path KV commit of every attention layer in one launch.

After the walk, each request's accepted node at depth ``d`` moves to the
cache slot of its ``d``-th token (right after its root), in every layer, the
slots looked up in the step's slot mapping inside the kernel. Done per
layer, that is a gather and a scatter for each of the (e.g. 36) layers, every
step. Here the layers' slot-row views (a slot's keys and values side by side,
vLLM's FlashAttention NHD cache) are addressed through a table of base
pointers and one program moves one request's path in one layer, depth by
depth. The moves are a device function, :func:`move_path_rows`, so that the
V2 runner's walk can make them in its own launch (``walk_trees_triton``'s
``kv_commit``): the walk's programs then run per request and layer.

Only the path moves: the rejected nodes' slots lie past the committed
tokens, and the next step writes its own tokens' KV there before anything
reads them. In place and in one pass because nodes are numbered best-first
(a parent before its children): the depth-``d`` node is node ``path[d] >=
d``, strictly increasing with ``d``. Moving depth by depth, ascending, the
move at depth ``d`` reads slot ``path[d]``, which no earlier move wrote
(they wrote slots below ``d``), and writes slot ``d``, which only earlier
moves may have read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def layer_rows_at(LAYER_ROWS, ANY_ROWS, layer):
    """Layer ``layer``'s slot rows, from the table of base addresses."""
    return tl.load(LAYER_ROWS + layer).to(tl.pointer_type(ANY_ROWS.dtype.element_ty))


@triton.jit
def move_path_rows(
    rows,  # one layer's [slots, width] rows
    SLOT_MAPPING,  # [tokens]: each batch token's cache slot
    root,  # batch token of the request's root
    path,  # [DP]: the request's accepted nodes by depth, -1 after them
    steps,  # [DP]: 0, 1, ...
    max_depth,
    width,
    row_stride,
    BLOCK: tl.constexpr,
):
    """Move one request's accepted path in one layer: the node at depth
    ``d`` (batch token ``root + path[d]``) to the slot of batch token
    ``root + d``, depth by depth (see the module docstring for why in
    place)."""
    for d in range(1, max_depth + 1):
        node = tl.sum(tl.where(steps == d, path, 0), axis=0)
        # Past the path (-1) or already in place: nothing moves.
        if node > d:
            src = tl.load(SLOT_MAPPING + root + node).to(tl.int64)
            dst = tl.load(SLOT_MAPPING + root + d).to(tl.int64)
            for start in range(0, width, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                in_row = cols < width
                row = tl.load(rows + src * row_stride + cols, mask=in_row)
                tl.store(rows + dst * row_stride + cols, row, mask=in_row)


@triton.jit(do_not_specialize=["stride_path", "max_depth"])
def _commit_path_rows_kernel(
    LAYER_ROWS,  # [L] int64: base address of each layer's [slots, width] rows
    ANY_ROWS,  # one layer's rows: their element type
    SLOT_MAPPING,  # [tokens]: each batch token's cache slot
    width,
    row_stride,
    ROOT,  # [R]: batch token of each request's root
    PATH,  # [R, max_depth + 1]: the walk's accepted nodes, -1 after them
    stride_path,
    max_depth,
    DP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    steps = tl.arange(0, DP)
    path = tl.load(PATH + r * stride_path + steps, mask=steps <= max_depth, other=-1)
    move_path_rows(
        layer_rows_at(LAYER_ROWS, ANY_ROWS, tl.program_id(1)),
        SLOT_MAPPING,
        tl.load(ROOT + r),
        path,
        steps,
        max_depth,
        width,
        row_stride,
        BLOCK,
    )


def address_table(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``[len(tensors)]`` int64 device table of the tensors' base addresses
    (the caller keeps the tensors alive)."""
    return torch.tensor(
        [t.data_ptr() for t in tensors], dtype=torch.int64, device=tensors[0].device
    )


class SlotRowsCommit:
    """The accepted paths' commit in the slot-row views of many layers.

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

    @property
    def num_layers(self) -> int:
        return len(self.layer_rows)

    def kernel_args(self, slot_mapping: torch.Tensor) -> tuple:
        """The commit's arguments of a kernel that moves the paths
        (:func:`move_path_rows`): the address table, the rows' element
        type, ``slot_mapping``, the row width and stride."""
        return (
            self.table,
            self.layer_rows[0],
            slot_mapping,
            self.width,
            self.row_stride,
        )

    def __call__(
        self, slot_mapping: torch.Tensor, roots: torch.Tensor, path: torch.Tensor
    ) -> None:
        """Move each request's accepted node at depth ``d`` (``path[r, d]``,
        the walk's) from its batch token's slot to the slot of batch token
        ``roots[r] + d`` (``slot_mapping``: the step's slot of every batch
        token)."""
        num_reqs, depth_slots = path.shape
        if num_reqs == 0:
            return
        _commit_path_rows_kernel[(num_reqs, self.num_layers)](
            *self.kernel_args(slot_mapping),
            roots,
            path,
            path.stride(0),
            depth_slots - 1,
            DP=triton.next_power_of_2(depth_slots),
            BLOCK=self.block,
        )
