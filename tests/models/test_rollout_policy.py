"""Every policy a rollout worker can hold answers one ``generate`` contract (``models.rollout_policy``) and declares
whether it batches continuously, which is what wires its worker's batcher (no probing for methods)."""

from __future__ import annotations

import inspect

import pytest

from omni_async.models.diffusion_policy import DiffusionPolicy
from omni_async.models.rollout_policy import RolloutPolicy, refuse_inapplicable
from omni_async.models.sim_policy import SimTextPolicy
from omni_async.models.text_policy import TextPolicy
from omni_async.models.vllm_text_policy import VLLMTextPolicy

POLICIES = [DiffusionPolicy, TextPolicy, SimTextPolicy, VLLMTextPolicy]


@pytest.mark.parametrize("cls", POLICIES, ids=lambda c: c.__name__)
def test_each_policy_takes_the_protocols_generate_call_and_declares_its_batching(cls):
    protocol = inspect.signature(RolloutPolicy.generate).parameters
    own = inspect.signature(cls.generate).parameters
    # The batcher's call: prompts, seeds and windows by position, the rest by keyword.
    assert list(own)[:3] == ["self", "prompts", "seeds"] and len(own) == len(protocol)
    for name in ("sampling", "resume", "should_stop"):
        assert own[name].kind is inspect.Parameter.KEYWORD_ONLY and own[name].default is None
    assert isinstance(cls.continuous_batching, bool)
    assert cls.continuous_batching == callable(getattr(cls, "generate_stream", None))


def test_an_argument_a_policy_cannot_honour_is_refused_by_name():
    refuse_inapplicable("P", windows=None, resume=None)  # nothing given: nothing to refuse
    with pytest.raises(ValueError, match=r"P.generate does not take resume, windows"):
        refuse_inapplicable("P", windows=[range(0, 2)], resume=[None], sampling=None)
