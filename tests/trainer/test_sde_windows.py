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


def test_mix_grpo_gives_every_sample_of_a_draw_the_schedules_window_of_its_step():
    """``model.algorithm=mix_grpo``: draw ``d`` is training step ``d + 1``; its samples share the window of
    ``algos.mix_grpo.mix_grpo_window`` (verl-omni's schedule), whatever ``sde_window_per_sample`` says; a new Draws
    (a resumed run) gives the same windows for the same draws."""
    from omni_async.algos.mix_grpo import mix_grpo_window

    mix = ["actor_rollout_ref.model.algorithm=mix_grpo", "actor_rollout_ref.actor.diffusion_loss.loss_mode=flow_grpo"]
    spec = {"num_inference_steps": 10, "window_size": 2, "window_range": (0, 9)}
    keys = ["actor_rollout_ref.rollout.num_inference_steps=10", "actor_rollout_ref.rollout.algo.sde_window_range=[0,9]"]
    for strategy, extra, kw in (
        ("random", ["actor_rollout_ref.rollout.algo.sde_window_seed=42"], {"sde_window_seed": 42}),
        ("random", [], {"sde_window_seed": 3}),  # null: the rollout seed (here trainer.seed=3)
        ("progressive", ["actor_rollout_ref.rollout.algo.iters_per_group=2"], {"iters_per_group": 2}),
    ):
        o = ops(*mix, *keys, f"actor_rollout_ref.rollout.algo.sample_strategy={strategy}", *extra)
        got = [windows(o, step=d) for d in range(8)]
        for d, w in enumerate(got):
            want = mix_grpo_window(d + 1, sample_strategy=strategy, **spec, **kw)
            assert w == [(want.start, want.stop)] * 16, (strategy, d)
        assert len({w[0] for w in got}) > 1  # the schedule moves the window
        again = ops(*mix, *keys, f"actor_rollout_ref.rollout.algo.sample_strategy={strategy}", *extra)
        assert [windows(again, step=d) for d in (5, 2)] == [got[5], got[2]]  # a resumed run: any draw, any order
    progressive = [
        windows(ops(*mix, *keys, "actor_rollout_ref.rollout.algo.sample_strategy=progressive"), d)[0] for d in range(5)
    ]
    assert [a for a, _ in progressive] == [2, 4, 6, 7, 7]  # from step 1: lo + g * size, held at hi - size
