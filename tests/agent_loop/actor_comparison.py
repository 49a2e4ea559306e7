"""What a vLLM rollout must agree on with the actor it samples for, checked by the tests that run the client against
the vLLM-API stand-in (``vllm_api_server.py``):

- the log-probs the server returns are the actor's log-probs of the same tokens (they become π_old);
- the tokens are drawn from the actor's distribution (pinned sampling: no top-k / top-p / penalty of the server's).

Token ids are not compared: a server samples with its own sampler and RNG (the stand-in does, as vLLM does), so its
tokens for a seed are not the actor's. ``test_vllm_text_rollout.py`` shows that each check fails against a server
that disagrees.
"""

from __future__ import annotations

import math

import torch

from omni_async.models.text_policy import TextPolicy
from omni_async.sample import TextResult


def recompute(policy: TextPolicy, rec: TextResult) -> torch.Tensor:
    """The actor's log-probs of a sampled response (what π_old must equal)."""
    p, r = torch.tensor([rec.prompt_ids]), torch.tensor([rec.response_ids])
    with torch.no_grad():
        return policy.log_probs(p, torch.ones_like(p), r, torch.ones_like(r))[0]


def assert_logprobs_are_the_actors(records: list[TextResult], policy: TextPolicy, atol: float = 1e-4) -> None:
    for rec in records:
        want = recompute(policy, rec)
        assert rec.log_probs.shape == want.shape, (rec.log_probs.shape, want.shape)
        err = float((rec.log_probs - want).abs().max())
        assert err <= atol, f"server log-probs differ from the actor's by up to {err:.2e} (> {atol:g})"


def rank_positions(records: list[TextResult], policy: TextPolicy) -> torch.Tensor:
    """Per sampled token, where it lies in the actor's distribution at that position:
    ``u = P(tokens the actor finds more likely) + P(the token) / 2``. For tokens drawn from that distribution ``u``
    has mean 1/2 and variance at most 1/12 (it is the mid-point of the token's interval of the actor's CDF, sorted by
    probability); tokens drawn from a truncated distribution (top-k, top-p) have ``u`` near 0."""
    out = []
    temperature = max(float(policy.sampling.temperature), 1e-5)
    for rec in records:
        ids = torch.tensor([rec.prompt_ids + rec.response_ids])
        with torch.no_grad():
            logits = policy.model(input_ids=ids).logits[0].float()
        n = len(rec.response_ids)
        probs = torch.softmax(logits[-n - 1 : -1] / temperature, -1)  # position i predicts response token i
        tok = torch.tensor(rec.response_ids)
        p_tok = probs.gather(-1, tok[:, None])
        out.append((probs * (probs > p_tok)).sum(-1) + p_tok[:, 0] / 2)
    return torch.cat(out)


def assert_drawn_from_the_actor(records: list[TextResult], policy: TextPolicy, sigmas: float = 4.0) -> None:
    """The mean of :func:`rank_positions` is 1/2 within ``sigmas`` standard deviations (sd <= sqrt(1/12 / n))."""
    u = rank_positions(records, policy)
    bound = sigmas * math.sqrt(1 / 12 / u.numel())
    mean = float(u.mean())
    assert abs(mean - 0.5) <= bound, (
        f"the {u.numel()} tokens are not the actor's distribution: mean rank position {mean:.3f}, "
        f"expected 0.5 +- {bound:.3f}"
    )
