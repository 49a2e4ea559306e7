"""Which SDE window each sample of a step runs (``StepOps.window``): a pure function of (seed, step, index)."""

from __future__ import annotations

from omni_async.modality import get_modality
from omni_async.trainer.config import compose, validate
from omni_async.trainer.step_ops import StepOps

BASE = ["data.train_files=x.jsonl", "actor_rollout_ref.rollout.n=8", "trainer.seed=3"]


def ops(*overrides: str) -> StepOps:
    return StepOps(validate(compose(BASE + list(overrides))), get_modality("image"), None, None, None, None, [])


def windows(o: StepOps, step: int = 1) -> list[tuple[int, int]]:
    return [s.window for s in o.make_samples(step, [object(), object()])]


def test_each_sample_draws_its_own_window_from_seed_step_index_or_one_per_step():
    per_sample = ops()  # default: actor_rollout_ref.rollout.algo.sde_window_per_sample=true, [0, 5), size 2
    w = windows(per_sample)
    assert len(w) == 16 and len(set(w)) > 1  # windows differ within a step (and within a prompt's group)
    assert all(0 <= a and b == a + 2 and b <= 5 for a, b in w)
    assert w == windows(ops())  # the same (seed, step, index) -> the same window: regenerations and layouts agree
    assert w != windows(per_sample, step=2)

    per_step = ops("actor_rollout_ref.rollout.algo.sde_window_per_sample=false")
    shared = windows(per_step)
    assert len(set(shared)) == 1 and shared[0] == w[0]  # sample 0's own draw, shared by all
    assert len({windows(per_step, step=s)[0] for s in range(8)}) > 1  # and a new one each step
