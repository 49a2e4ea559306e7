"""Continuous batching of text generation (``TextPolicy.generate_stream`` and the rollout workers' sessions): rows
join and leave between tokens, each response is answered when it ends, and what is sampled does not change."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from omni_async.agent_loop.batcher import DeviceThread, GenerationBatcher
from omni_async.models.text_policy import TextPolicy, TextSamplingConfig

ALPHA = 1.2  # the long tail of the benchmark: budgets from 6 to 64 tokens


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return TextPolicy(
        "tiny:qwen2", TextSamplingConfig(response_length=64, response_length_pareto_alpha=ALPHA), lora_rank=4
    )


def prompts(n: int) -> tuple[list[str], list[int]]:
    return [f"what is {i} + {2 * i}?" for i in range(n)], [1000 + i for i in range(n)]


class ForwardRows:
    """Counts the rows of every forward of the model (prefills and decode steps)."""

    def __init__(self, model: torch.nn.Module):
        self.rows: list[int] = []
        self.handle = model.register_forward_hook(lambda _m, args, kwargs, _out: self._seen(kwargs), with_kwargs=True)

    def _seen(self, kwargs) -> None:
        self.rows.append(int(kwargs["input_ids"].shape[0]))

    def close(self) -> None:
        self.handle.remove()


def stream(policy: TextPolicy, ps: list[str], seeds: list[int], capacity: int):
    queue = list(zip(range(len(ps)), ps, seeds, [None] * len(ps), strict=True))
    order, out = [], {}

    def admit(free: int):
        taken = queue[:free]
        del queue[:free]
        return taken

    def emit(key, result):
        order.append(key)
        out[key] = result

    policy.generate_stream(admit, emit, capacity=capacity)
    return order, out


def test_stream_samples_what_static_batches_sample(policy):
    """Same (prompt, seed, weights) -> same tokens, whoever shares the batch and whenever a row joins; log-probs
    equal the recomputed ones (float noise of other batch shapes only)."""
    ps, seeds = prompts(12)
    static = policy.generate(ps, seeds)
    order, out = stream(policy, ps, seeds, capacity=3)
    assert sorted(order) == list(range(12))
    for i, s in enumerate(static):
        assert out[i].response_ids == s.response_ids
        assert torch.allclose(out[i].log_probs, s.log_probs, atol=1e-5)
        r = out[i]
        recomputed = policy.log_probs(
            torch.tensor([r.prompt_ids]),
            torch.ones(1, len(r.prompt_ids), dtype=torch.long),
            torch.tensor([r.response_ids]),
            torch.ones(1, len(r.response_ids), dtype=torch.long),
        )[0].detach()
        assert torch.allclose(recomputed, r.log_probs, atol=1e-5)
    lengths = [len(s.response_ids) for s in static]
    assert len(set(lengths)) > 3  # the long tail is there: the test is not about equal lengths


def test_stream_answers_short_responses_first_and_computes_no_padding_rows(policy):
    """Responses are emitted as they end (not in admission order); every forward runs only live rows (the rows of
    all forwards add up to the tokens kept: a prefill row yields a response's first token, a decode row one more);
    free rows are refilled, so the device runs fewer forwards than static batches of the same size, each of which
    lasts as long as its longest response."""
    ps, seeds = prompts(32)
    seen = ForwardRows(policy.model)
    try:
        order, out = stream(policy, ps, seeds, capacity=4)
    finally:
        seen.close()
    assert order != sorted(order)
    tokens = sum(len(r.response_ids) for r in out.values())
    assert sum(seen.rows) == tokens
    assert max(seen.rows) == 4

    static = ForwardRows(policy.model)
    try:
        for i in range(0, 32, 4):
            policy.generate(ps[i : i + 4], seeds[i : i + 4])
    finally:
        static.close()
    # Static batches drop finished rows too, but run as many forwards as their longest response needs.
    # (1.35x here; the ratio depends only on the seeds' length budgets and the tiny model's EOS draws.)
    assert len(static.rows) > 1.25 * len(seen.rows)


def long_requests(policy: TextPolicy, n: int, min_tokens: int) -> tuple[list[str], list[int]]:
    """``n`` (prompt, seed) pairs whose responses have at least ``min_tokens`` tokens."""
    ps, seeds = prompts(64)
    lengths = [len(r.response_ids) for r in policy.generate(ps, seeds)]
    picked = [i for i, n_tok in enumerate(lengths) if n_tok >= min_tokens][:n]
    assert len(picked) == n
    return [ps[i] for i in picked], [seeds[i] for i in picked]


def test_session_takes_requests_that_arrive_while_it_runs_and_yields_to_other_device_calls(policy):
    """A rollout worker's session (``GenerationBatcher`` with ``stream``): requests submitted after it started join
    it; a call queued on the device thread (a weight write, an update) stops admission, so it runs before the
    requests submitted after it, which a later session serves; every response comes back, as sampled alone."""
    device = DeviceThread("test-device")
    started, joined = threading.Event(), threading.Event()

    def session(admit, emit, capacity):
        calls = []

        def admit_seen(free):
            taken = admit(free)
            calls.append(len(taken))
            if len(calls) > 1 and taken:
                joined.set()
            return taken

        started.set()
        policy.generate_stream(admit_seen, emit, capacity=capacity)

    batcher = GenerationBatcher(policy.generate, lambda: 7, device, max_batch_size=4, max_wait_ms=0.0, stream=session)
    long_ps, long_seeds = long_requests(policy, 2, 48)  # they keep the first session running
    ps, seeds = prompts(6)
    wrote: list[float] = []

    async def main():
        first = [asyncio.create_task(batcher.submit(p, s, None)) for p, s in zip(long_ps, long_seeds, strict=True)]
        while not started.is_set():
            await asyncio.sleep(0.001)
        joining = [asyncio.create_task(batcher.submit(p, s, None)) for p, s in zip(ps[:2], seeds[:2], strict=True)]
        while not joined.is_set():
            await asyncio.sleep(0.001)
        write = asyncio.get_running_loop().run_in_executor(device, lambda: wrote.append(time.time()))
        after = [asyncio.create_task(batcher.submit(p, s, None)) for p, s in zip(ps[2:], seeds[2:], strict=True)]
        return await asyncio.gather(*first, *joining), await asyncio.gather(*after), await write

    (before, after, _) = asyncio.run(main())
    device.shutdown()
    alone = policy.generate(long_ps + ps, long_seeds + seeds)
    assert [g.result.response_ids for g in before + after] == [r.response_ids for r in alone]
    assert {g.version for g in before + after} == {7}
    assert all(len(g.result.versions) == len(g.result.response_ids) for g in before + after)  # each token stamped
    assert batcher.batch_sizes[0] == 4  # two requests joined the session the first two started
    assert all(g.gen_start > wrote[0] for g in after)  # the queued write went before them
    assert len(batcher.batch_sizes) >= 2
