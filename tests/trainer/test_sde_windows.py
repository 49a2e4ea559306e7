"""Which SDE window each sample of a draw runs (``Draws.window``): a pure function of (seed, draw, index)."""

from __future__ import annotations

from omni_async.agent_loop.draws import Draws
from omni_async.trainer.config import compose, validate

BASE = ["data.train_files=x.jsonl", "actor_rollout_ref.rollout.n=8", "trainer.seed=3"]


def ops(*overrides: str) -> Draws:
    return Draws.from_config(validate(compose(BASE + list(overrides))), None, uses_window=True)


def windows(o: Draws, step: int = 1) -> list[tuple[int, int]]:
    return [s.window for s in o.samples(step, [object(), object()])]


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
