"""The trainable part of a policy, shared by the diffusion and text policies: LoRA via peft on one module (the
diffusion transformer, or the causal LM), or that whole module for a full fine-tune; the weights a sync ships; the
reference policy for KL (the same module with the adapter switched off)."""

from __future__ import annotations

import contextlib
import copy

import torch

# The adapter the rollout reads in the hybrid layout when an update may run while it generates (one-step
# off-policy, the mini-batch pipeline): a frozen copy of the live ("default") adapter at the last published version.
LIVE_ADAPTER, ROLLOUT_ADAPTER = "default", "rollout"


class TrainableModule:
    """Mixin: the policy sets ``self.trainable`` (an ``nn.Module`` with peft's adapter API) and calls
    :meth:`init_trainable` once."""

    trainable: torch.nn.Module
    lora: bool

    def init_trainable(self, module: torch.nn.Module, lora_rank: int, lora_alpha: int, target_modules: list[str]) -> None:
        self.trainable, self.lora = module, lora_rank > 0
        if self.lora:
            from peft import LoraConfig

            module.add_adapter(LoraConfig(r=lora_rank, lora_alpha=lora_alpha, init_lora_weights=True,
                                          target_modules=list(target_modules)))
        else:
            module.requires_grad_(True)
        # Trainable weights (and so AdamW's state) are fp32 whatever the frozen weights' dtype.
        self.rebind_trainable_parameters()
        for p in self._trainable:
            p.data = p.data.float()

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        # Fixed at init: peft's set_adapter flips requires_grad, so it is no longer a test of "trained".
        return self._trainable

    def rebind_trainable_parameters(self) -> None:
        """Read the trainable parameters again after a wrapper replaced them (FSDP2's ``fully_shard`` registers
        sharded ones); call it before the optimizer is built, while no adapter switch has flipped requires_grad."""
        self._trainable = [p for p in self.trainable.parameters() if p.requires_grad]

    def snapshot_for_rollout(self) -> None:
        """Copy the live LoRA adapter into the rollout adapter (created on first use): a device-local copy of the
        adapter, the hybrid layout's weight sync when updates overlap generation."""
        if not self.lora:
            raise RuntimeError("a rollout snapshot needs LoRA (actor_rollout_ref.model.lora_rank > 0); a full "
                               "fine-tune overlapping rollout needs actor_rollout_ref.hybrid_engine=False")
        from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

        module = self.trainable
        if ROLLOUT_ADAPTER not in module.peft_config:
            module.add_adapter(copy.deepcopy(module.peft_config[LIVE_ADAPTER]), adapter_name=ROLLOUT_ADAPTER)
            module.set_adapter(LIVE_ADAPTER)  # add_adapter activates the new one
            for name, p in module.named_parameters():
                if f".{ROLLOUT_ADAPTER}." in name:
                    p.data = p.data.float()
        set_peft_model_state_dict(module, get_peft_model_state_dict(module, adapter_name=LIVE_ADAPTER),
                                  adapter_name=ROLLOUT_ADAPTER)

    @contextlib.contextmanager
    def rollout_adapter(self):
        """Generate with the rollout snapshot; the live adapter (and its requires_grad) is restored after."""
        self.trainable.set_adapter(ROLLOUT_ADAPTER)
        try:
            yield
        finally:
            self.trainable.set_adapter(LIVE_ADAPTER)

    def weights_state_dict(self) -> dict[str, torch.Tensor]:
        """The trainable weights only (LoRA adapter, or the full module): what a weight sync ships."""
        if self.lora:
            from peft.utils import get_peft_model_state_dict

            return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.trainable).items()}
        return {k: v.detach().clone() for k, v in self.trainable.state_dict().items()}

    def weights_views(self) -> dict[str, torch.Tensor]:
        """The keys of :meth:`weights_state_dict`, as tensors sharing storage with the parameters (no copy): what a
        bucketed sync reads from (trainer) or writes into (rollout worker) in place."""
        if self.lora:
            from peft.utils import get_peft_model_state_dict

            views = get_peft_model_state_dict(self.trainable)
        else:
            views = self.trainable.state_dict()
        return {k: v.detach() for k, v in views.items()}

    def freeze_for_inference(self, dtype: torch.dtype) -> None:
        """Make this an inference-only copy (a rollout worker): nothing requires a gradient, and a full fine-tune's
        trainable module is stored in the frozen weights' ``dtype`` (LoRA adapters stay fp32 as trained: small).
        No optimizer is ever built on it."""
        self.trainable.requires_grad_(False)
        if not self.lora:
            self.trainable.to(dtype)
            if hasattr(self, "compute_dtype"):  # the diffusion transformer's input dtype follows its weights
                self.compute_dtype = dtype
        self._trainable = []

    def load_weights_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.lora:
            from peft.utils import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.trainable, state)
            if getattr(result, "unexpected_keys", None):
                raise KeyError(f"LoRA weights do not match this model: {result.unexpected_keys[:3]}")
        else:
            self.trainable.load_state_dict(state)

    @contextlib.contextmanager
    def reference(self):
        """The reference policy for KL: the same model with the LoRA adapter switched off."""
        if not self.lora:
            raise RuntimeError("a reference policy needs LoRA (actor_rollout_ref.model.lora_rank > 0) "
                               "when actor_rollout_ref.actor.kl_loss_coef > 0")
        self.trainable.disable_adapters()
        try:
            yield
        finally:
            self.trainable.enable_adapters()
