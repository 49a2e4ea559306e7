"""MixGRPO's window schedule pinned to verl-omni's rollout adapter (``qwen_image_mix_grpo`` at a1139ba): progressive
positions written out by hand, random draws against Python's ``random`` seeded as there, and the refusals."""

import random
from collections import Counter

import pytest

from omni_async.algos.mix_grpo import mix_grpo_window


def prog(step, lo=0, hi=10, size=2, ipg=3, n=10):
    return mix_grpo_window(
        step,
        num_inference_steps=n,
        window_size=size,
        window_range=(lo, hi),
        sample_strategy="progressive",
        iters_per_group=ipg,
    )


def test_progressive_positions_by_hand():
    # start = min(lo + (g // ipg) * size, hi - size): g = 1, 2 -> 0; 3..5 -> 2; 6..8 -> 4; 9..11 -> 6; then 8 for good
    starts = [prog(g).start for g in range(1, 16)]
    assert starts == [0, 0, 2, 2, 2, 4, 4, 4, 6, 6, 6, 8, 8, 8, 8]
    assert prog(1000) == range(8, 10)  # parked at the last position, window whole
    assert all(len(prog(g)) == 2 for g in range(1, 40))


def test_progressive_envelope_and_verl_omnis_first_step():
    # inside [1, 6) with size 2: starts 1, 3, then clipped to 4 (a whole window inside the envelope)
    assert [prog(g, lo=1, hi=6, ipg=1).start for g in range(0, 5)] == [1, 3, 4, 4, 4]
    # verl-omni's step counter starts at 1: with iters_per_group = 1 the first trained window is already the second
    assert prog(1, ipg=1) == range(2, 4)


def test_random_is_verl_omnis_seeded_draw():
    kw = dict(num_inference_steps=10, window_size=2, window_range=(0, 5), sample_strategy="random")
    for g in range(1, 30):
        want = random.Random(42 + g).randint(0, 3)  # verl-omni: Random(seed + global_steps).randint(lo, hi - size)
        assert mix_grpo_window(g, sde_window_seed=42, **kw) == range(want, want + 2)
    # the draw depends on seed + step only (so every worker, and a resumed run, agrees)
    assert mix_grpo_window(5, sde_window_seed=10, **kw) == mix_grpo_window(7, sde_window_seed=8, **kw)


def test_random_covers_the_envelope_uniformly():
    kw = dict(num_inference_steps=12, window_size=3, window_range=(2, 9), sample_strategy="random")
    counts = Counter(mix_grpo_window(g, sde_window_seed=0, **kw).start for g in range(1, 5001))
    assert set(counts) == {2, 3, 4, 5, 6}  # start in [lo, hi - size]: the window never leaves [2, 9)
    assert all(abs(c / 5000 - 0.2) < 0.03 for c in counts.values())


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(sample_strategy="decay"), "sample_strategy"),
        (dict(window_range=(0, 11)), "not within the 10 denoising steps"),
        (dict(window_range=(3, 4)), "fewer steps than sde_window_size=2"),
        (dict(window_size=0), "sde_window_size=0"),
        (dict(sample_strategy="progressive", iters_per_group=0), "iters_per_group=0"),
    ],
)
def test_refusals_name_the_key(kw, match):
    args = dict(num_inference_steps=10, window_size=2, window_range=(0, 5), sample_strategy="random") | kw
    with pytest.raises(ValueError, match=match):
        mix_grpo_window(1, **args)
