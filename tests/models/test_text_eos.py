"""TextPolicy stops at the first of any EOS id: generation_config.eos_token_id may be an int or a list
(Qwen2.5/Qwen3-Instruct ship ``[<|im_end|>, <|endoftext|>]``)."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig

from omni_async.models.text_policy import TextPolicy, TextSamplingConfig
from omni_async.models.tiny import resolve_model_path


@pytest.fixture(scope="module")
def two_eos_model(tmp_path_factory):
    """tiny:qwen2 with generation_config.eos_token_id = [<|im_end|>, <|endoftext|>]."""
    path = tmp_path_factory.mktemp("qwen2_two_eos") / "model"
    shutil.copytree(resolve_model_path("tiny:qwen2"), path)
    gc = GenerationConfig.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    gc.eos_token_id = ids
    gc.save_pretrained(path)
    return str(path), ids


def force_token(policy: TextPolicy, token: int, from_step: int) -> None:
    """From generation step ``from_step`` (0-based) on, make ``token`` the certain next token."""
    calls = {"n": 0}

    def hook(_module, _inputs, logits):
        step = calls["n"]
        calls["n"] += 1
        if step >= from_step:
            logits = logits.clone()
            logits[..., token] += 1e4
        return logits

    policy.model.get_output_embeddings().register_forward_hook(hook)


def test_int_eos_still_stops(no_network):
    policy = TextPolicy("tiny:qwen2", TextSamplingConfig(response_length=12), lora_rank=0)
    im_end = policy.tok.convert_tokens_to_ids("<|im_end|>")
    assert isinstance(policy.model.generation_config.eos_token_id, int) and policy.eos_ids == [im_end]
    force_token(policy, im_end, from_step=2)
    (res,) = policy.generate(["hi"], seeds=[0])
    assert len(res.response_ids) == 3 and res.response_ids[-1] == im_end and len(res.log_probs) == 3


@pytest.mark.parametrize("which", [0, 1])
def test_list_eos_stops_at_either_id(two_eos_model, which, no_network):
    path, ids = two_eos_model
    policy = TextPolicy(path, TextSamplingConfig(response_length=12), lora_rank=0)
    assert policy.eos_ids == ids
    force_token(policy, ids[which], from_step=3)
    results = policy.generate(["hi", "a longer prompt"], seeds=[0, 1])
    for res in results:
        # three sampled tokens, then the EOS; nothing after it is kept, scored or trained on
        assert len(res.response_ids) == 4 and res.response_ids[-1] == ids[which]
        assert not set(res.response_ids[:-1]) & set(ids)
        assert res.log_probs.shape == (4,) and res.log_probs[-1].item() == pytest.approx(0.0, abs=1e-3)


def test_list_eos_cuts_at_the_first_of_any(two_eos_model, no_network):
    path, ids = two_eos_model
    policy = TextPolicy(path, TextSamplingConfig(response_length=12), lora_rank=0)
    calls = {"n": 0}

    def hook(_module, _inputs, logits):  # step 1: the second id; step 2 onwards: the first id
        step = calls["n"]
        calls["n"] += 1
        logits = logits.clone()
        if step == 1:
            logits[..., ids[1]] += 1e4
        elif step >= 2:
            logits[..., ids[0]] += 1e4
        return logits

    policy.model.get_output_embeddings().register_forward_hook(hook)
    (res,) = policy.generate(["hi"], seeds=[0])
    assert res.response_ids[1] == ids[1] and len(res.response_ids) == 2 and res.log_probs.shape == (2,)
    assert torch.isfinite(res.log_probs).all()
