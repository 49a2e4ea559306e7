"""MixGRPO (arXiv 2507.21802): where the SDE window sits on a training step's trajectories.

MixGRPO samples ODE outside one contiguous window of ``window_size`` denoising steps and SDE inside it, and trains
only the window, exactly as FlowGRPO's window here (``sde.sde_window``). What it changes is how the window is placed:
one window per training step, shared by every sample of the step, moved over training by a schedule. With the window
inside ``[lo, hi)`` (``rollout.algo.sde_window_range``) and ``g`` the training step (verl's ``global_steps``, 1 at
the first step)::

    random:       start = Random(sde_window_seed + g).randint(lo, hi - window_size)     (Python's ``random``,
                                                                                        both ends inclusive)
    progressive:  start = min(lo + (g // iters_per_group) * window_size, hi - window_size)

and the window is ``range(start, start + window_size)``. ``random`` re-draws the window every step, seeded so every
rollout worker agrees; ``progressive`` walks it from the high-noise end toward the low-noise end, one window length
every ``iters_per_group`` steps, and then stays at the last position.

This is verl-omni's MixGRPO rollout adapter at a1139ba (``qwen_image_mix_grpo``, same RNG and seeding, so the same
windows for the same keys). Where the MixGRPO authors' code (``fastvideo/utils/grpo_states.py``) differs, verl-omni
is followed: there the progressive window counts iterations from 0, so it holds its first position for
``iters_per_group`` iterations where verl-omni's (``g`` from 1) holds it ``iters_per_group - 1`` steps (with
``iters_per_group = 1``: never); its envelope is ``[0, T - 2]`` for ``T`` sampling steps, and at the end it clips the
start, not the window (the last windows are shorter), or rolls back to 0; ``random`` draws with numpy's generator.
Nothing here is trained differently from FlowGRPO: the loss, the advantages and the SDE step are FlowGRPO's.
"""

from __future__ import annotations

import random

SAMPLE_STRATEGIES = ("random", "progressive")


def mix_grpo_window(
    global_step: int,
    *,
    num_inference_steps: int,
    window_size: int,
    window_range: tuple[int, int],
    sample_strategy: str = "random",
    sde_window_seed: int = 0,
    iters_per_group: int = 1,
) -> range:
    """The SDE window (denoising step indices, 0-based) of every sample of training step ``global_step`` (verl's
    1-based step counter) under MixGRPO's ``sample_strategy`` (module docstring); the other steps run as ODE.

    ``window_range``: ``[lo, hi)``, the window lies wholly inside it (``rollout.algo.sde_window_range``);
    ``sde_window_seed`` is read by ``random`` only, ``iters_per_group`` by ``progressive`` only. Raises
    ``ValueError`` naming the key for a strategy, range or group length that cannot place a window.
    """
    if sample_strategy not in SAMPLE_STRATEGIES:
        raise ValueError(
            f"actor_rollout_ref.rollout.algo.sample_strategy={sample_strategy!r} is not one of {SAMPLE_STRATEGIES}"
        )
    lo, hi = (int(v) for v in window_range)
    size = int(window_size)
    if size < 1:
        raise ValueError(f"actor_rollout_ref.rollout.algo.sde_window_size={size}: MixGRPO needs at least 1 SDE step")
    if lo < 0 or hi > num_inference_steps:
        raise ValueError(
            f"actor_rollout_ref.rollout.algo.sde_window_range [{lo}, {hi}) is not within the "
            f"{num_inference_steps} denoising steps"
        )
    if hi - lo < size:
        raise ValueError(
            f"actor_rollout_ref.rollout.algo.sde_window_range [{lo}, {hi}) holds fewer steps than "
            f"sde_window_size={size}"
        )
    last = hi - size
    if sample_strategy == "random":
        # Python's Mersenne Twister seeded with an int is stable across versions and platforms: every worker, and a
        # resumed run, places the window of step g alike.
        start = random.Random(int(sde_window_seed) + int(global_step)).randint(lo, last)
    else:
        if iters_per_group < 1:
            raise ValueError(f"actor_rollout_ref.rollout.algo.iters_per_group={iters_per_group} must be >= 1")
        start = min(lo + (max(0, int(global_step)) // int(iters_per_group)) * size, last)
    return range(start, start + size)
