"""verl-omni's ``model.attn_backend`` and verl's ``actor.use_torch_compile`` (``models.acceleration``): each option
that runs on CPU keeps the first update's ratio at 1 (pg_clipfrac 0 at verl-omni's clip_ratio 1e-5) in bf16, and
every other one is refused, at start or where the policy is built, naming the key, what is missing and the fix."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from omni_async.config_error import ConfigError
from omni_async.modality.image import ImageModality
from omni_async.models import acceleration
from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig
from omni_async.sample import PromptRow, RewardOutcome, Sample
from omni_async.trainer.actor_core import TensorBatch, accumulate_gradients
from omni_async.trainer.config import compose, validate

KEY = "actor_rollout_ref.model.attn_backend"
# What this box cannot run, and the package diffusers' check names for it (installed ones are accepted instead).
PACKAGES = {"flash": "flash-attn", "_flash_3_varlen_hub": "kernels", "sage": "sageattention", "xformers": "xformers"}


def _start(*overrides: str):
    return validate(compose(["data.train_files=x.jsonl", *overrides]))


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_a_backend_whose_package_is_missing_is_refused_at_start_naming_it(name):
    if acceleration.backend_problem(name) is None:  # installed here: accepted at start
        _start(f"{KEY}={name}")
        return
    with pytest.raises(ConfigError) as err:
        _start(f"{KEY}={name}")
    message = str(err.value)
    assert message.startswith(f"{KEY}={name}:") and PACKAGES[name] in message and "Fix:" in message, message
    assert "install" in message and "native" in message.split("Fix:")[1], message


def test_an_unknown_backend_is_refused_naming_the_valid_ones_and_text_takes_none():
    with pytest.raises(ConfigError, match=f"{KEY}=flash_attention_2: unknown") as err:
        _start(f"{KEY}=flash_attention_2")
    assert all(b in str(err.value) for b in ("native", "_native_math", "flex", "flash_varlen", "_flash_3_varlen_hub"))
    text = ["actor_rollout_ref.model.modality=text", "actor_rollout_ref.model.algorithm=grpo"]
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.use_torch_compile: .* diffusion settings"):
        _start(*text, "actor_rollout_ref.actor.use_torch_compile=true")
    with pytest.raises(ConfigError, match="compiled blocks under FSDP2"):
        _start("actor_rollout_ref.actor.use_torch_compile=true", "trainer.n_gpus_per_node=2")
    assert _start(f"{KEY}=_native_math", "actor_rollout_ref.actor.use_torch_compile=true").actor_rollout_ref


def test_verl_omnis_rollout_backend_must_pair_with_the_model_backend():
    from omni_async.config.overrides import OverrideError, check_overrides

    check_overrides([f"{KEY}=native", "actor_rollout_ref.rollout.rollout_attn_backend=TORCH_SDPA"])
    with pytest.raises(OverrideError, match="rollout_attn_backend.*Fix:.*native <-> TORCH_SDPA"):
        check_overrides([f"{KEY}=native", "actor_rollout_ref.rollout.rollout_attn_backend=FLASH_ATTN_3_HUB"])
    with pytest.raises(OverrideError, match="ref.use_torch_compile"):
        check_overrides(["actor_rollout_ref.ref.use_torch_compile=true"])  # the actor's is false


def test_the_build_refuses_what_the_device_or_the_model_cannot_run():
    from diffusers import QwenImageTransformer2DModel, SD3Transformer2DModel

    qwen = QwenImageTransformer2DModel(
        num_layers=1, num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=4,
        joint_attention_dim=16, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    sd3 = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
    )  # fmt: skip
    with pytest.raises(ValueError, match=f"{KEY}=_native_efficient: a CUDA kernel.*Fix: use one of native"):
        acceleration.set_attention_backend([qwen], "_native_efficient", "cpu")
    with pytest.raises(ValueError, match="masks its text.*takes no mask. Fix: use native"):
        acceleration.set_attention_backend([qwen], "_native_flash", "cuda")  # refused before anything runs
    with pytest.raises(ValueError, match="SD3Transformer2DModel's attention processors call torch SDPA themselves"):
        acceleration.set_attention_backend([sd3], "_native_math", "cpu")
    acceleration.set_attention_backend([sd3], "native", "cpu")
    # Regional compilation's blocks: Qwen-Image's _repeated_blocks, SD3's transformer_blocks (it names none).
    assert [type(b).__name__ for b in acceleration.repeated_blocks(qwen)] == ["QwenImageTransformerBlock"]
    assert len(acceleration.repeated_blocks(sd3)) == 1
    with pytest.raises(ValueError, match="use_torch_compile: Linear has no repeated blocks"):
        acceleration.compile_repeated_blocks([torch.nn.Linear(2, 2)])


def test_each_cpu_backend_keeps_the_first_updates_ratio_at_one_in_bf16(monkeypatch):
    """Tiny Qwen-Image in bf16 with true CFG 4 (its two branches of different text lengths: a masked call) and a
    trained adapter, built as a worker builds it from ``actor_rollout_ref.model`` with ``_native_math`` (and
    ``use_torch_compile``: the blocks it compiles recorded, not compiled, see the next test), then switched to
    ``native``: with each backend in effect the rollout's log-prob (pi_old) and the update's first forward agree to
    |ratio - 1| <= 1e-5 per sample, and nothing is clipped at verl-omni's clip_ratio 1e-5. (flex runs on CPU too,
    unfused and ~10x slower: not run here.)"""
    compiled: list[str] = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compiled.append(type(self).__name__))
    torch.manual_seed(0)
    cfg = SamplingConfig(height=32, width=32, num_inference_steps=2, noise_level=0.7, true_cfg_scale=4.0)
    model = {"path": "tiny:qwen_image", "lora_rank": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_k", "to_v"]}
    policy = ImageModality().build_policy(
        {**model, "attn_backend": "_native_math"}, vars(cfg), dtype=torch.bfloat16, compile_blocks=True
    )
    assert isinstance(policy, DiffusionPolicy) and compiled == ["QwenImageTransformerBlock"] * 2
    with torch.no_grad():  # a trained adapter (B != 0): the LoRA branch is part of every forward
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    seen: list[torch.Tensor] = []
    step = policy.step

    def recording_step(*args, **kwargs):
        out = step(*args, **kwargs)
        if torch.is_grad_enabled():  # the update's forwards
            seen.append(out.log_prob.detach())
        return out

    monkeypatch.setattr(policy, "step", recording_step)
    prompts, seeds, window = ["a sign", "a much longer prompt about a red sign"], [3, 4], range(0, 1)
    modality = ImageModality()
    actor_cfg = OmegaConf.create(
        {"diffusion_loss": {"clip_ratio": 1e-5}, "kl_loss_coef": 0.0, "ppo_micro_batch_size_per_gpu": 1}
    )
    for backend in ("_native_math", "native"):
        acceleration.set_attention_backend([policy.transformer], backend, "cpu")
        processors = [m.processor for m in policy.transformer.modules() if hasattr(m, "processor")]
        assert processors and {p._attention_backend for p in processors} == {backend}
        results = policy.generate(prompts, seeds, window)
        samples = [
            Sample(i, f"g{i}", PromptRow(p, "t", ""), s, result=r, outcome=RewardOutcome("ok", 0.0))
            for i, (p, s, r) in enumerate(zip(prompts, seeds, results, strict=True))
        ]
        batch = TensorBatch(
            {
                **modality.batch_tensors(samples),
                "advantages": torch.tensor([1.0, -1.0]),
                "loss_mask": torch.ones(2, dtype=torch.bool),
            },
            {"window_start": window.start},
        )
        seen.clear()
        metrics = accumulate_gradients(modality, policy, batch, actor_cfg)
        policy.transformer.zero_grad(set_to_none=True)
        ratio = torch.exp(torch.cat(seen).flatten() - torch.stack([r.log_probs for r in results]).flatten())
        assert len(ratio) == 2 and (ratio - 1).abs().max() <= 1e-5, (backend, ratio)
        assert metrics["actor/pg_clipfrac"] == [0.0, 0.0], backend


def test_regional_compilation_compiles_each_block_in_place_and_trains_through_it(monkeypatch):
    """``use_torch_compile``'s blocks on a one-block tiny Qwen-Image transformer with LoRA: each repeated block is
    compiled in place (Dynamo captures it, parameters stay the same objects), the forward with and without autograd
    equals the eager one bit for bit, and the LoRA weights get the eager gradient. The aot_eager backend (Dynamo's
    capture and AOTAutograd's forward / backward graphs, no code generation) stands in for inductor, whose C++ build
    of tiny Qwen-Image's blocks took ~10 CPU-minutes here: run once by hand (docs/gpu_and_memory.md), inductor
    moved the first update's log-prob by 2.1e-4 from the rollout's, and with emulate_precision_casts (which the
    compile sets; checked below) gave the eager log-probs bit for bit, ratio 1, pg_clipfrac 0 at 1e-5."""
    from diffusers import QwenImageTransformer2DModel
    from peft import LoraConfig
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(
        num_layers=1, num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=4,
        joint_attention_dim=16, axes_dims_rope=(4, 6, 6),
    ).to(torch.bfloat16)  # fmt: skip
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, init_lora_weights=False, target_modules=["to_q", "to_v"]))
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    inputs = dict(
        hidden_states=torch.randn(1, 4, 16, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(1, 3, 16, dtype=torch.bfloat16),
        timestep=torch.tensor([0.5]),
        img_shapes=[(1, 2, 2)],
        return_dict=False,
    )

    def run(grad: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with torch.set_grad_enabled(grad):
            out = model(**inputs)[0]
        if not grad:
            return out, []
        model.zero_grad(set_to_none=True)
        out.float().square().mean().backward()
        return out.detach(), [p.grad.clone() for p in lora]

    eager_out, eager_grads = run(True)
    params = [id(p) for p in model.parameters()]
    eager_compile = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: eager_compile(self, backend="aot_eager"))
    counters.clear()
    assert acceleration.compile_repeated_blocks([model]) == 1
    import torch._inductor.config as inductor_config

    assert inductor_config.emulate_precision_casts
    assert model.transformer_blocks[0]._compiled_call_impl is not None
    assert [id(p) for p in model.parameters()] == params
    inference, _ = run(False)
    trained, grads = run(True)
    assert counters["stats"]["unique_graphs"] >= 2  # the no-grad and the autograd graph of the block
    assert torch.equal(inference, eager_out) and torch.equal(trained, eager_out)
    assert all(torch.equal(g, e) for g, e in zip(grads, eager_grads, strict=True))
