"""Data parallelism without Ray or a process group: the split by uid groups, the loss weighting that makes the
ranks' summed gradient the single-rank one (a masked sample on one rank only included), the metric merge, and the
one-rank path. The collectives themselves run on real Ray workers in ``test_data_parallel_ranks.py``."""

from __future__ import annotations

import os

import numpy as np
import torch
from verl import DataProto

from omni_async.trainer import data_parallel as dpm
from omni_async.trainer.data_parallel import (
    DP_INDEX_KEY,
    collect_rows,
    lockstep,
    loss_scales,
    merge_rank_metrics,
    shard_batch,
    split_groups,
)


def test_split_keeps_groups_whole_balances_samples_and_is_deterministic():
    uids = ["a"] * 4 + ["b"] * 2 + ["c"] * 2 + ["d"] * 4 + ["e"] * 1
    parts = split_groups(uids, 2)
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(uids)))  # every row once
    for p in parts:
        assert list(p) == sorted(p)  # batch order inside a rank
        for u in {uids[i] for i in p}:  # whole groups
            assert {i for i, v in enumerate(uids) if v == u} <= set(p.tolist())
    assert sorted(len(p) for p in parts) == [6, 7]
    assert all((a == b).all() for a, b in zip(parts, split_groups(uids, 2), strict=True))
    assert [len(p) for p in split_groups(["x", "x"], 3)] == [2, 0, 0]


def test_shards_round_trip_and_an_idle_rank_gets_a_masked_padding_row():
    uids = np.array(["a", "b", "a", "b", "c", "c"], dtype=object)
    data = DataProto.from_dict(
        tensors={"v": torch.arange(6.0), "loss_mask": torch.ones(6, dtype=torch.bool)},
        non_tensors={"uid": uids},
        meta_info={"window_start": 1},
    )
    shares = shard_batch(data, 2)
    assert [s.meta_info["window_start"] for s in shares] == [1, 1]
    out = collect_rows(None, [(s.meta_info[DP_INDEX_KEY], s.batch["v"] * 10) for s in shares])
    assert torch.equal(out, torch.arange(6.0) * 10)
    one_group = data.select_idxs(np.array([0, 2]))
    shares = shard_batch(one_group, 2)
    assert [len(s) for s in shares] == [2, 1]
    assert shares[1].meta_info[DP_INDEX_KEY].tolist() == [-1] and not shares[1].batch["loss_mask"].any()
    assert dpm.trained_samples(shares[1]) == 0
    out = collect_rows(None, [(s.meta_info[DP_INDEX_KEY], s.batch["v"]) for s in shares])
    assert out.tolist() == [0.0, 2.0]


def test_sequence_parallel_groups_share_one_data_parallel_share_and_count_it_once():
    """Ulysses (``models.sequence_parallel``): 4 ranks at sp=2 are 2 data-parallel ranks; each share goes to both
    ranks of its group, one rank per group is collected, and the loss weights count each group's units once."""
    from types import SimpleNamespace

    uids = np.array(["a", "a", "b", "b", "c", "c"], dtype=object)
    data = DataProto.from_dict(
        tensors={"v": torch.arange(6.0), "loss_mask": torch.ones(6, dtype=torch.bool)}, non_tensors={"uid": uids}
    )
    group = SimpleNamespace(world_size=4, sequence_parallel_size=2)
    (shares,), _ = dpm.dispatch_by_groups(group, data)
    idx = [s.meta_info[DP_INDEX_KEY].tolist() for s in shares]
    assert idx[0] == idx[1] and idx[2] == idx[3] and sorted(idx[0] + idx[2]) == list(range(6))
    out = collect_rows(group, [(s.meta_info[DP_INDEX_KEY], s.batch["v"] * 10) for s in shares])
    assert torch.equal(out, torch.arange(6.0) * 10)  # each row once, in batch order
    metrics = [{"actor/pg_loss": [float(r)]} for r in (1, 1, 3, 3)]
    assert dpm.collect_metrics(group, metrics)["actor/pg_loss"] == 2.0
    # rank units 4, 4 (group 0) and 2, 2 (group 1): 6 samples in all, not 12
    assert loss_scales([4.0], _Ranks([4, 4, 2, 2], sp=2)) == [4 / 6]


class _Ranks:
    """``DataParallel.sum`` of a group whose every rank's local value is known (no process group needed)."""

    def __init__(self, locals_: list[float], sp: int = 1):
        self.total, self.sp = sum(locals_), sp

    def sum(self, x: float) -> float:
        return self.total


def test_fsdp2_lockstep_gives_every_pass_the_busiest_ranks_rows_outside_the_loss():
    """Each transformer call of a sharded model is a collective and a diffusion policy calls it once per sample in
    the SDE window, so every rank's pass k runs as many rows as the largest pass k of any rank (here this rank's
    [2, 1] against another rank's [2, 2, 2]): missing passes repeat the first at weight 0, missing rows are copies of
    the pass's first row with loss_mask False."""
    data = DataProto.from_dict(
        tensors={"v": torch.arange(3.0), "loss_mask": torch.ones(3, dtype=torch.bool)}, meta_info={"window_start": 1}
    )

    class OtherRankHas3PassesOf2:  # DataParallel.max against the other rank's values, in lockstep's call order
        other = [3, 2, 2, 2]

        def max(self, x):
            return float(max(x, self.other.pop(0)))

    micro, scales = lockstep(data.split(2), [0.5, 0.25], OtherRankHas3PassesOf2())
    assert [len(m) for m in micro] == [2, 2, 2] and scales == [0.5, 0.25, 0.0]
    assert micro[1].batch["v"].tolist() == [2.0, 2.0] and micro[1].batch["loss_mask"].tolist() == [True, False]
    assert micro[1].meta_info["window_start"] == 1 and data.batch["loss_mask"].all()  # the input is untouched


def test_weighted_rank_gradients_sum_to_the_single_rank_gradient_with_a_sample_masked_on_one_rank():
    torch.manual_seed(0)
    x, y = torch.randn(7, 3), torch.randn(7)
    keep = torch.tensor([1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)  # sample 2 failed: only rank 0 holds a masked one
    w0 = torch.randn(3)

    def grad(rows, micro, dp):
        """Accumulated gradient of the mean kept loss over ``rows`` in micro-batches, weighted by loss_scales."""
        w = w0.clone().requires_grad_(True)
        chunks = [rows[i : i + micro] for i in range(0, len(rows), micro)]
        units = [float(keep[c].sum()) for c in chunks]
        for c, n, s in zip(chunks, units, loss_scales(units, dp), strict=True):
            if n:
                m = keep[c].float()
                (((x[c] @ w - y[c]) ** 2 * m).sum() / m.sum() * s).backward()
        return w.grad

    single = grad(list(range(7)), 7, None)
    ranks = [[0, 1, 2], [3, 4, 5, 6]]
    dp = _Ranks([float(keep[r].sum()) for r in ranks])  # 2 and 4 kept units
    summed = grad(ranks[0], 2, dp) + grad(ranks[1], 3, dp)
    assert torch.allclose(summed, single, atol=1e-6)
    plain_mean = (grad(ranks[0], 3, None) + grad(ranks[1], 4, None)) / 2  # what naive DDP averaging would give
    assert not torch.allclose(plain_mean, single, atol=1e-3)


def test_rank_metrics_merge():
    merged = merge_rank_metrics(
        [
            {"actor/pg_loss": [1.0, 2.0], "actor/grad_norm": [5.0], "timing_s/ref": [1.0, 2.0], dpm.SAMPLES_KEY: [4.0]},
            {"actor/pg_loss": [6.0], "actor/grad_norm": [5.0], "timing_s/ref": [0.5], dpm.SAMPLES_KEY: [3.0]},
        ],
        time_keys=("timing_s/ref",),
    )
    assert merged == {"actor/pg_loss": 3.0, "actor/grad_norm": 5.0, "timing_s/ref": 3.0, dpm.SAMPLES_KEY: 4.0}


# ---- one rank -------------------------------------------------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 1)


class Policy:  # the part of a policy the checkpoint helpers use
    def __init__(self, module):
        self.trainable = module

    def weights_state_dict(self):
        return {k: v.detach().clone() for k, v in self.trainable.state_dict().items()}

    def load_weights_state_dict(self, state):
        self.trainable.load_state_dict(state)


def test_one_rank_is_the_plain_path(monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dp = dpm.DataParallel("cpu")
    assert not dp.active and dp.sum(3.0) == 3.0 and loss_scales([1, 3], dp) == [0.25, 0.75]
    net = Net()
    opt = torch.optim.AdamW(net.parameters())
    dpm.save_actor(tmp_path, Policy(net), opt, dp)
    assert sorted(os.listdir(tmp_path)) == [dpm.LORA_CKPT]
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with torch.no_grad():
        net.lin.weight.add_(1.0)
    dpm.load_actor(tmp_path, Policy(net), opt, dp)
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())
