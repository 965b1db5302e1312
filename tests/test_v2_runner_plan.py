# SPDX-License-Identifier: Apache-2.0
"""The V2 runner's per-step glue on the CPU, without an engine.

vLLM's V2 runner needs a GPU, so these tests build a
:class:`DDTreeV2ModelRunner` without running its constructor and give it the
few attributes the two DDTree steps read: ``_plan_verify`` (trees gathered by
request-state slot, depth positions in the persistent position buffer, the
tree attention rows) and ``_commit_path`` (the KV moves of the accepted
paths, the speculator's token order).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_ddtree.config import DDTreeConfig
from vllm_ddtree.v1.ops.triton_tree_cores import PathFirstOrder
from vllm_ddtree.v1.spec_decode.tree import DraftTrees, WalkResult
from vllm_ddtree.v1.worker.gpu.model_runner import DDTreeV2ModelRunner
from vllm_ddtree.v1.worker.gpu.spec_decode.ddtree.rejection_sampler import (
    WalkedTrees,
)
from vllm_ddtree.v1.worker.verify_plan import LayoutStager, path_first_order

# Request-state slot 2: root + nodes 1..4 with parents 0, 0, 1, 3 (depths 1,
# 1, 2, 3); slot 0: a prefill row (no drafts) between the two trees; slot 1:
# root + a chain of 2.
SLOT_TREES = {
    2: ([0, 0, 1, 3], [1, 1, 2, 3]),
    1: ([0, 1], [1, 2]),
}
BATCH_SLOTS = [2, 0, 1]
NUM_DRAFTS = np.array([4, 0, 2], dtype=np.int32)
PREFILL_LEN = 3
CONTEXT = [10, 0, 20]  # tokens before each row's query (root / prompt)


def _runner() -> tuple[DDTreeV2ModelRunner, SimpleNamespace]:
    budget = 4
    trees = DraftTrees(
        tokens=torch.zeros(3, budget, dtype=torch.long),
        parents=torch.zeros(3, budget, dtype=torch.long),
        depths=torch.zeros(3, budget, dtype=torch.long),
        scores=torch.zeros(3, budget),
    )
    for slot, (parents, depths) in SLOT_TREES.items():
        trees.parents[slot, : len(parents)] = torch.tensor(parents)
        trees.depths[slot, : len(depths)] = torch.tensor(depths)
    runner = DDTreeV2ModelRunner.__new__(DDTreeV2ModelRunner)
    runner.ddtree = DDTreeConfig(budget=budget, max_depth=15, adaptive_budget=False)
    runner.layouts = LayoutStager("cpu")
    runner.device = torch.device("cpu")
    runner._uniform_trees = {}
    runner.speculator = SimpleNamespace(
        req_tree_shapes=(trees.parents, trees.depths), order=None
    )
    runner.speculator.set_accepted_order = lambda order: setattr(
        runner.speculator, "order", order
    )
    runner.rejection_sampler = SimpleNamespace(step=None)
    runner.input_buffers = SimpleNamespace(positions=torch.zeros(32, dtype=torch.long))
    # Token slots 100 + batch token index, in the one KV-cache group.
    runner.block_tables = SimpleNamespace(slot_mappings=100 + torch.arange(32)[None])
    # One layer whose "KV" at each slot is the slot's own number, committed
    # by the layer-by-layer path (no all-layers kernel on a CPU).
    cache = torch.arange(200)

    def copy_kv_slots(kv_cache, src, dst):
        kv_cache[dst] = kv_cache[src]

    impl = SimpleNamespace(copy_kv_slots=copy_kv_slots)
    runner._kv_commits = {0: ([(impl, cache)], None)}

    query_lens = NUM_DRAFTS + 1
    query_lens[1] = PREFILL_LEN
    query_start = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    linear = np.concatenate(
        [np.arange(c, c + n) for c, n in zip(CONTEXT, query_lens, strict=True)]
    )
    runner.input_buffers.positions[: len(linear)] = torch.from_numpy(linear)
    seq_lens = torch.tensor([c + n for c, n in zip(CONTEXT, query_lens, strict=True)])
    batch = SimpleNamespace(
        num_reqs=3,
        num_draft_tokens=int(NUM_DRAFTS.sum()),
        num_draft_tokens_per_req=NUM_DRAFTS,
        query_start_loc_np=query_start,
        idx_mapping=torch.tensor(BATCH_SLOTS, dtype=torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        seq_lens_cpu_upper_bound=seq_lens,
    )
    return runner, SimpleNamespace(batch=batch, cache=cache, linear=linear)


def test_plan_moves_nodes_to_depth_positions_and_describes_the_trees():
    runner, case = _runner()
    plan = runner._plan_verify(case.batch)

    positions = runner.input_buffers.positions[: len(case.linear)].tolist()
    # Row 0 (slot 2): root at 10, nodes at depths 1, 1, 2, 3.
    assert positions[0:5] == [10, 11, 11, 12, 13]
    # Row 1: a prefill chunk keeps its positions.
    assert positions[5:8] == [0, 1, 2]
    # Row 2 (slot 1): a chain, depth = node index.
    assert positions[8:11] == [20, 21, 22]

    tree = plan.tree
    assert tree.req_rows_cpu == [0, 2]
    assert tree.q_start_cpu == [0, 8]
    assert tree.num_nodes_cpu == [5, 3]
    assert tree.ctx_len.tolist() == [10, 20]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 3], [-1, 0, 1, -1, -1]]
    assert not tree.covers_batch  # the prefill row is not a tree
    step = runner.rejection_sampler.step
    assert step.parents.shape == (3, 5)
    assert step.parents[1].tolist() == [-1] * 5


@pytest.mark.parametrize("upto", [3, 2])
def test_short_prefill_rows_become_chain_rows_of_the_tree_pass(upto):
    """With ``chain_rows_upto`` at least the prefill row's query (3 tokens)
    the prefill row is a chain tree row, so the tree rows cover the batch
    (FlashAttention sits the step out); one token less keeps it out."""
    runner, case = _runner()
    runner.layouts = LayoutStager("cpu", chain_rows_upto=upto)
    plan = runner._plan_verify(case.batch)
    tree = plan.tree
    # The walk's view is unchanged: the prefill row verifies one token.
    assert plan.layout.num_nodes.tolist() == [5, 1, 3]
    positions = runner.input_buffers.positions[: len(case.linear)].tolist()
    assert positions[5:8] == [0, 1, 2]  # the prefill chunk keeps its positions
    if upto < PREFILL_LEN:
        assert tree.req_rows_cpu == [0, 2]
        assert not tree.covers_batch
        return
    assert tree.covers_batch
    assert tree.req_rows_cpu == [0, 1, 2]
    assert tree.q_start_cpu == [0, 5, 8]
    assert tree.num_nodes_cpu == [5, PREFILL_LEN, 3]
    assert tree.ctx_len.tolist() == [10, 0, 20]
    assert tree.ctx_len_cpu == [10, 0, 20]
    assert tree.parents[1].tolist() == [-1, 0, 1, -1, -1]
    # Its ancestor mask is causal attention over the chunk.
    chunk = torch.ones(PREFILL_LEN, PREFILL_LEN, dtype=torch.bool).tril()
    assert torch.equal(tree.mask[1, :PREFILL_LEN, :PREFILL_LEN], chunk)
    assert not tree.mask[1, :PREFILL_LEN, PREFILL_LEN:].any()
    # The trees keep theirs.
    assert tree.parents[0].tolist() == [-1, 0, 0, 1, 3]


def test_uniform_batches_are_filled_by_the_lay_out_on_a_gpu():
    """The lay-out launch fills the graph buffers only for a batch of trees
    of one size that has buffers, up to their rows (graph padding counted),
    and only on a GPU (the lay-out's CPU path has no fill)."""
    from vllm_ddtree.v1.attention.backends.tree_attn import UniformTreeBuffers

    runner, case = _runner()
    buffers = UniformTreeBuffers(4, 5, 64, torch.device("cpu"))
    runner._uniform_trees = {5: buffers}

    def target(num_nodes, padded_rows):
        batch = SimpleNamespace(num_reqs_after_padding=padded_rows)
        return runner._uniform_target(batch, np.array(num_nodes), max(num_nodes))

    assert target([5, 5, 5], 4) is None  # a CPU runner
    runner.device = torch.device("cuda")
    uniform = target([5, 5, 5], 4)
    assert uniform.buffers is buffers and uniform.num_reqs == 4
    assert target([5, 1, 5], 3) is None  # a prefill row
    assert target([5, 5, 5], 5) is None  # more rows than the buffers hold
    assert target([3, 3], 2) is None  # a tree size without buffers


def test_commit_moves_the_accepted_path_and_restores_positions():
    runner, case = _runner()
    plan = runner._plan_verify(case.batch)
    # Row 0 accepts node 2 (a leaf); row 2 its whole chain 0 -> 1 -> 2.
    path = torch.full((3, 16), -1, dtype=torch.long)
    path[:, 0] = 0
    path[0, 1] = 2
    path[2, 1:3] = torch.tensor([1, 2])
    walk = WalkResult(
        path=path,
        num_accepted=torch.tensor([1, 0, 2]),
        bonus=torch.zeros(3, dtype=torch.long),
    )
    # The walk's launch writes the order on a GPU (the order's own test:
    # test_v2_tree_walk.py); two rows of CUDA-graph padding after the batch.
    positions = runner.input_buffers.positions
    order = path_first_order(plan.layout, path, len(case.linear) + 2, positions)
    path_first = PathFirstOrder(plan.layout.root_index, order, positions)
    # A CPU runner's walk does not commit (see the next test).
    assert runner.rejection_sampler.step.kv_commit is None
    runner._commit_path(WalkedTrees(walk, path_first, kv_committed=False))

    kv = case.cache.tolist()
    # Row 0: node 2's KV (slot 102) in the slot after its root (101); the
    # rejected nodes' slots are not committed.
    assert kv[100:102] == [100, 102]
    # Row 2: the chain is already in place; no other slot changed.
    assert kv[108:111] == [108, 109, 110]
    assert kv[:101] + kv[102:] == list(range(101)) + list(range(102, 200))
    positions = runner.input_buffers.positions[: len(case.linear)]
    assert positions.tolist() == case.linear.tolist()
    order = runner.speculator.order.tolist()
    assert order[:5] == [0, 2, 1, 3, 4]
    assert order[5:] == list(range(5, len(case.linear) + 2))


def test_walk_commits_kv_only_for_one_group_with_a_one_launch_commit():
    """The walk's launch takes the KV commit when the target's attention
    layers are one KV-cache group with a one-launch commit, with that
    group's slot mapping; otherwise the runner commits after the walk, and
    a walk that committed is not committed again."""
    commit = object()

    def walk_commit(plan):
        runner, _ = _runner()
        runner._kv_commits = plan
        # Two KV-cache groups' slot mappings.
        runner.block_tables.slot_mappings = torch.arange(64).view(2, 32)
        return runner._walk_kv_commit

    layer = [(None, None)]
    got_commit, slots = walk_commit({1: (layer, commit)})
    assert got_commit is commit
    assert slots.tolist() == list(range(32, 64))
    assert walk_commit({0: (layer, None)}) is None
    assert walk_commit({0: (layer, commit), 1: (layer, commit)}) is None

    runner, case = _runner()
    plan = runner._plan_verify(case.batch)
    path = torch.full((3, 16), -1, dtype=torch.long)
    path[:, 0] = 0
    path[0, 1] = 2  # would move slot 102 to 101
    walk = WalkResult(path, torch.tensor([1, 0, 0]), torch.zeros(3, dtype=torch.long))
    order = torch.arange(len(case.linear) + 2)
    path_first = PathFirstOrder(plan.layout.root_index, order, None)
    runner._commit_path(WalkedTrees(walk, path_first, kv_committed=True))
    assert case.cache.tolist() == list(range(200))
    assert runner.speculator.order is order


def test_target_step_skips_drafter_only_attention_groups():
    """The target step builds no metadata for a group made only of drafter
    layers (the drafter builds its own); mixed groups stay, and the
    speculator's own groups pass through untouched."""
    from vllm_ddtree.v1.worker.gpu.model_runner import target_attn_groups

    def group(*names):
        return SimpleNamespace(layer_names=list(names))

    tree, draft, mixed = group("t.0", "t.1"), group("d.0"), group("t.2", "d.1")
    runner = DDTreeV2ModelRunner.__new__(DDTreeV2ModelRunner)
    runner.attn_groups = [[tree, draft], [mixed]]
    runner._target_attn_groups = target_attn_groups(runner.attn_groups, {"d.0", "d.1"})
    assert runner._target_attn_groups == [[tree], [mixed]]

    seen = []
    runner.model_state = SimpleNamespace(
        prepare_attn=lambda *args, **kwargs: seen.append(args[4])
    )
    runner._plan = None
    # load_model's wrapper, without loading a model.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            "vllm.v1.worker.gpu.model_runner.GPUModelRunner.load_model",
            lambda self, *args, **kwargs: None,
        )
        runner.rejection_sampler = None
        runner.load_model()
    speculator_groups = [[draft]]
    runner.model_state.prepare_attn(None, None, None, None, runner.attn_groups, None)
    runner.model_state.prepare_attn(None, None, None, None, speculator_groups, None)
    assert seen == [[[tree], [mixed]], speculator_groups]


@pytest.mark.parametrize(
    ("drafts", "chain_steps"),
    [
        ([4, 0, 4], True),  # chains and a prompt
        ([4, 0, 2], False),  # a chain cut short by the token budget
        ([3, 3, 3], False),  # trees
    ],
)
def test_chain_steps_run_no_tree_plan(monkeypatch, drafts, chain_steps):
    """With chain steps (chains of 4 = the budget here), a step whose every
    draft is a chain's length is left to V2: no trees laid out or published
    to the attention and the sampler, linear positions. Any other verify
    step plans its trees (the chains among them as the trees the speculator
    keeps for them); without chain steps every verify step does."""
    monkeypatch.setattr(
        "vllm.v1.worker.gpu.model_runner.GPUModelRunner.prepare_attn",
        lambda self, batch: ("block tables", "slot mappings"),
    )
    for chain_from in (None, 2):
        runner, case = _runner()
        runner.ddtree = DDTreeConfig(
            budget=4,
            max_depth=15,
            adaptive_budget=False,
            model_runner="v2",
            chain_from_batch_size=chain_from,
        )
        case.batch.num_draft_tokens_per_req = np.array(drafts, dtype=np.int32)
        planned: list = []

        def plan(batch, planned=planned):
            planned.append(batch)
            return "plan"

        runner._plan_verify = plan
        runner._plan = "last step's"
        assert runner.prepare_attn(case.batch) == ("block tables", "slot mappings")
        left_to_v2 = chain_from is not None and chain_steps
        assert runner._plan == (None if left_to_v2 else "plan")
        assert planned == ([] if left_to_v2 else [case.batch])


def test_chain_steps_need_vllms_schedule():
    from vllm_ddtree.v1.worker.gpu.model_runner import check_chain_steps

    def config(async_scheduling, schedule, max_num_seqs=16):
        return SimpleNamespace(
            scheduler_config=SimpleNamespace(
                async_scheduling=async_scheduling, max_num_seqs=max_num_seqs
            ),
            speculative_config=SimpleNamespace(
                num_speculative_tokens_per_batch_size=schedule
            ),
        )

    cfg = DDTreeConfig(budget=64, max_depth=15, chain_from_batch_size=16)
    schedule = [(1, 15, 64), (16, 1 << 20, 15)]
    check_chain_steps(config(True, schedule), cfg)
    with pytest.raises(ValueError, match="chain_from_batch_size needs async"):
        check_chain_steps(config(False, schedule), cfg)
    with pytest.raises(ValueError, match="data parallelism"):
        check_chain_steps(config(True, None), cfg)
    with pytest.raises(ValueError, match="= 16 is more than max_num_seqs = 8"):
        check_chain_steps(config(True, schedule, max_num_seqs=8), cfg)
