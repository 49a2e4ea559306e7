"""The trainable part of a policy, shared by the diffusion and text policies: LoRA via peft on one module (the
diffusion transformer, or the causal LM), or that whole module for a full fine-tune; the weights a sync ships; the
reference policy for KL (the same module with the adapter switched off).

Precision. The trainable weights compute in the frozen weights' dtype (bf16 on CUDA): the module holds them as a
*working copy* in that dtype, and the optimizer steps fp32 *master* weights (:class:`MasterWeights`). Each backward
moves a working weight's gradient into its master's fp32 ``.grad`` as soon as it is accumulated, so gradients
accumulate over micro-batches in fp32; after each optimizer step :meth:`TrainableModule.refresh_working_weights`
rounds the masters into the working copy. Without it, peft's LoRA layer casts every LoRA site's input to the fp32
adapter's dtype and runs two skinny fp32 GEMMs per site, and a full fine-tune keeps a whole fp32 transformer on the
device before FSDP2 shards it. fp32 frozen weights (the CPU default) make the working weights their own masters.

Masters are made on the first :meth:`TrainableModule.trainable_parameters` call (the optimizer's), so a full
fine-tune that FSDP2 shards first (``trainer.data_parallel.shard_module``: fp32 shards, bf16 compute) and a
generation-only replica never hold a full fp32 copy.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch

from omni_async.algos.diffusion_nft import ema_update_

# The adapter the rollout reads in the hybrid layout when an update may run while it generates (one-step
# off-policy, the mini-batch pipeline): a frozen copy of the adapter the rollout samples with (the live "default"
# one; DiffusionNFT's "old" one) at the last published version.
LIVE_ADAPTER, ROLLOUT_ADAPTER = "default", "rollout"
# DiffusionNFT's lagging policy (verl-omni's policy_state_adapters=["default","old"]): the rollout samples with it and
# the loss's v_old is its prediction; refreshed from the live weights by an EMA (algos.diffusion_nft). AWM's EMA
# anchor is the same adapter, which only its loss reads (algos.awm).
OLD_ADAPTER = "old"


def dominant_dtype(module: torch.nn.Module) -> torch.dtype:
    """The floating dtype holding most of a module's parameters (diffusers keeps a few small modules in fp32)."""
    count: Counter[torch.dtype] = Counter()
    for p in module.parameters():
        if p.is_floating_point():
            count[p.dtype] += p.numel()
    return count.most_common(1)[0][0] if count else torch.float32


def _grad_to_master(master: torch.nn.Parameter, working: torch.Tensor) -> None:
    """Post-accumulate-grad hook of a working weight: its gradient moves into the master's fp32 ``.grad``."""
    g = working.grad.float()
    if master.grad is None:
        master.grad = g
    else:
        master.grad.add_(g)
    working.grad = None


class MasterWeights:
    """fp32 master copies of the low-precision trainable weights of a module (fp32 ones are their own masters)."""

    def __init__(self, module: torch.nn.Module, names: list[str]):
        params = dict(module.named_parameters())
        owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):  # every owner of a tied weight
            prefix, _, attr = name.rpartition(".")
            owners.setdefault(id(p), []).append((module.get_submodule(prefix), attr))
        self.masters: list[torch.nn.Parameter] = []
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter, list[tuple[torch.nn.Module, str]]]] = []
        self._hooks = []
        for name in names:
            p = params[name]
            if p.dtype == torch.float32:
                self.masters.append(p)
                continue
            master = torch.nn.Parameter(p.detach().float(), requires_grad=True)
            self._hooks.append(p.register_post_accumulate_grad_hook(partial(_grad_to_master, master)))
            self.pairs.append((p, master, owners[id(p)]))
            self.masters.append(master)

    def refresh(self) -> None:
        """Round the masters into the working copy (in place: modules and autograd keep the same tensors)."""
        with torch.no_grad():
            for working, master, _ in self.pairs:
                working.copy_(master)

    @contextlib.contextmanager
    def installed(self, refresh: bool = True) -> Iterator[None]:
        """The masters registered on the module in place of the working weights (state dicts read and load fp32,
        and an optimizer over the masters maps to the module's names); the working copy is refreshed after (a
        load may have changed the masters) unless ``refresh=False`` (a read)."""
        for _, master, owners in self.pairs:
            for mod, attr in owners:
                mod._parameters[attr] = master
        try:
            yield
        finally:
            for working, _, owners in self.pairs:
                for mod, attr in owners:
                    mod._parameters[attr] = working
            if refresh:
                self.refresh()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


@dataclass(frozen=True)
class PolicyOptions:
    """The keyword arguments every trainable policy's constructor takes (``modality.base.trainable_kwargs`` fills them
    from ``actor_rollout_ref.model``): LoRA on the trained module (rank 0: a full fine-tune of it), and where and in
    which dtype the frozen weights live."""

    lora_rank: int = 8
    lora_alpha: int = 16
    target_modules: list[str] | None = None  # None: the policy's own default
    device: str = "cpu"
    dtype: torch.dtype = torch.float32  # the frozen weights' (fsdp_config.model_dtype)
    gradient_checkpointing: bool = False
    # verl's model.override_config: a random:<family> pipeline's per-component configs (models.random_models), a
    # causal LM's Hugging Face config keys (verl's meaning)
    override_config: dict | None = None
    # diffusion only (models.acceleration): verl-omni's model.attn_backend, verl's actor.use_torch_compile
    attn_backend: str = "native"
    compile_blocks: bool = False


class TrainableModule:
    """Mixin: the policy sets ``self.trainable`` (an ``nn.Module`` with peft's adapter API) and calls
    :meth:`init_trainable` once."""

    trainable: torch.nn.Module
    lora: bool

    def init_trainable(
        self,
        module: torch.nn.Module,
        lora_rank: int,
        lora_alpha: int,
        target_modules: list[str],
        dtype: torch.dtype | None = None,
    ) -> None:
        """``dtype``: what the trainable weights compute in; ``None`` = the module's (the frozen weights') dtype. A
        full fine-tune's weights stay as loaded (no fp32 copy here: see the module docstring)."""
        self.trainable, self.lora = module, lora_rank > 0
        self.work_dtype = dtype or dominant_dtype(module)
        if self.lora:
            from peft import LoraConfig

            module.add_adapter(
                LoraConfig(
                    r=lora_rank, lora_alpha=lora_alpha, init_lora_weights=True, target_modules=list(target_modules)
                )
            )
        else:
            module.requires_grad_(True)
        # Fixed at init: peft's set_adapter flips requires_grad, so it is no longer a test of "trained".
        self._trainable_names = [n for n, p in module.named_parameters() if p.requires_grad]
        if self.lora:
            for name, p in module.named_parameters():
                if f".{LIVE_ADAPTER}." in name:
                    p.data = p.data.to(self.work_dtype)  # peft makes the adapter fp32; compute in the base dtype
        self._masters: MasterWeights | None = None
        self._old: OldPolicy | None = None
        self._synced: list[torch.Tensor] | None = None  # keep_synced_weights' copy (the last sync's weights)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps and the gradient clip / all-reduce reads: fp32 masters (made on first call)."""
        if self._masters is None:
            self._masters = MasterWeights(self.trainable, self._trainable_names)
        return self._masters.masters

    def rebind_trainable_parameters(self) -> None:
        """Read the trainable parameters again after a wrapper replaced them (FSDP2's ``fully_shard`` registers
        sharded fp32 ones, their own masters); call it before the optimizer is built."""
        if self._masters is not None:
            self._masters.remove()
        self._masters = MasterWeights(self.trainable, self._trainable_names)

    def refresh_working_weights(self) -> None:
        """After the masters changed (an optimizer step, a broadcast): the working copy takes their values."""
        if self._masters is not None:
            self._masters.refresh()

    @contextlib.contextmanager
    def master_weights(self, refresh: bool = True) -> Iterator[None]:
        """The module's trainable weights are the fp32 masters inside the block (a rollout copy without an optimizer
        has none: its module keeps the working copy); ``refresh=False`` for a block that only reads them."""
        with self._masters.installed(refresh) if self._masters is not None else contextlib.nullcontext():
            yield

    def snapshot_for_rollout(self, source: str = LIVE_ADAPTER) -> None:
        """Copy the ``source`` LoRA adapter (the live one, or DiffusionNFT's ``old``) into the rollout adapter
        (created on first use): a device-local copy, the hybrid layout's weight sync when updates overlap
        generation."""
        if not self.lora:
            raise RuntimeError(
                "a rollout snapshot needs LoRA (actor_rollout_ref.model.lora_rank > 0); a full "
                "fine-tune overlapping rollout needs actor_rollout_ref.hybrid_engine=False"
            )
        from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

        module = self.trainable
        if ROLLOUT_ADAPTER not in module.peft_config:
            module.add_adapter(copy.deepcopy(module.peft_config[LIVE_ADAPTER]), adapter_name=ROLLOUT_ADAPTER)
            module.set_adapter(LIVE_ADAPTER)  # add_adapter activates the new one
            for name, p in module.named_parameters():
                if f".{ROLLOUT_ADAPTER}." in name:
                    p.data = p.data.to(self.work_dtype)
        # The source adapter's working copy: exactly the weights it computes with.
        set_peft_model_state_dict(
            module, get_peft_model_state_dict(module, adapter_name=source), adapter_name=ROLLOUT_ADAPTER
        )

    @contextlib.contextmanager
    def rollout_adapter(self):
        """Generate with the rollout snapshot; the live adapter (and its requires_grad) is restored after."""
        self.trainable.set_adapter(ROLLOUT_ADAPTER)
        try:
            yield
        finally:
            self.trainable.set_adapter(LIVE_ADAPTER)

    # ---- the weights of the last sync (pi_old in verl's decoupled mode) ----------------------------------------
    def _forward_weights(self) -> list[tuple[torch.Tensor, bool]]:
        """Per trainable weight, the tensor its forwards compute with and whether that tensor is its own master: a
        low-precision working copy (rounded from its fp32 master by :meth:`refresh_working_weights`) or, fp32, the
        master itself (one rank's fp32 weights; an FSDP2 rank's shard, whose forwards read it gathered)."""
        masters = self.trainable_parameters()
        working = {id(m): w for w, m, _ in self._masters.pairs}
        return [(working[id(m)], False) if id(m) in working else (_local(m), True) for m in masters]

    def keep_synced_weights(self) -> None:
        """Keep a copy of the weights the forwards compute with now, the weights of the last sync, for
        :meth:`synced_weights` (verl's fully async trainer: ``save_model_to_cpu(1)`` at the first local update after
        a sync). A LoRA adapter's copy stays on its device; a full fine-tune's goes to the CPU, as verl's does. It
        is the working copy (bf16 on CUDA: 2 bytes a weight) where one exists, else the fp32 master (an FSDP2 rank:
        its shard). A later call overwrites the copy in place."""
        with torch.no_grad():
            weights = [t for t, _ in self._forward_weights()]
            device = weights[0].device if self.lora else torch.device("cpu")
            if self._synced is None or [k.shape for k in self._synced] != [w.shape for w in weights]:
                self._synced = [torch.empty(w.shape, dtype=w.dtype, device=device) for w in weights]
            for kept, w in zip(self._synced, weights, strict=True):
                kept.copy_(w)

    @contextlib.contextmanager
    def synced_weights(self, gather: Callable[[], None] | None = None) -> Iterator[None]:
        """Forwards inside the block run the weights kept by :meth:`keep_synced_weights`; the live ones after (verl's
        ``restore_model_from_cpu`` of the saved parameters, then of the current ones). The copy is written into the
        working copy, which is rounded from the untouched masters again after; a weight that is its own master is
        stashed beside the copy first and written back after. The optimizer's tensors and state stay as they are.
        ``gather``: what makes the forwards read the masters (FSDP2: gather the shards again), run after each swap."""
        if self._synced is None:
            raise RuntimeError(
                "no synced weights kept: keep_synced_weights runs at the first pi_old recompute after a weight sync"
            )
        with torch.no_grad():
            weights = self._forward_weights()
            stash = [
                t.to(k.device, copy=True) if own else None for (t, own), k in zip(weights, self._synced, strict=True)
            ]
            for (t, _), kept in zip(weights, self._synced, strict=True):
                t.copy_(kept)
        if gather is not None:
            gather()
        try:
            yield
        finally:
            with torch.no_grad():
                for (t, _), live in zip(weights, stash, strict=True):
                    if live is not None:
                        t.copy_(live)
            self.refresh_working_weights()
            if gather is not None:
                gather()

    # ---- DiffusionNFT's old policy ----------------------------------------------------------------------------
    @property
    def has_old_policy(self) -> bool:
        return self._old is not None

    def init_old_policy(self) -> None:
        """Make the ``old`` policy a copy of the live weights (call after the optimizer exists: it copies the fp32
        masters). LoRA: a second peft adapter, ``old``, on the same base (verl-omni's ``policy_state_adapters``);
        full fine-tune: a copy of the transformer's trainable weights, swapped in for the old policy's forwards.
        Either way fp32 masters of ``old`` take the EMA (:meth:`refresh_old`) and round into the working copy, so a
        ``1 - decay`` of 0.001 is not lost to bf16's resolution."""
        masters = self.trainable_parameters()
        if self.lora:
            module = self.trainable
            if OLD_ADAPTER not in module.peft_config:
                module.add_adapter(copy.deepcopy(module.peft_config[LIVE_ADAPTER]), adapter_name=OLD_ADAPTER)
                module.set_adapter(LIVE_ADAPTER)  # add_adapter activates the new one
            params = dict(module.named_parameters())
            working = [params[_old_name(n)] for n in self._trainable_names]
            for p in working:
                p.requires_grad_(False)
                p.data = p.data.to(self.work_dtype)
        else:
            params = dict(self.trainable.named_parameters())
            working = [params[n].detach().clone() for n in self._trainable_names]
        self._old = OldPolicy(working, [m.detach().float().clone() for m in masters])
        self._old.write()

    def refresh_old(self, decay: float) -> float:
        """``old <- decay * old + (1 - decay) * theta`` on the fp32 masters, rounded into the working copy; returns
        the L2 distance the old masters moved (``(1 - decay) x`` their gap to the live masters before)."""
        old = self._require_old()
        before = [m.clone() for m in old.master]
        ema_update_(old.master, [m.detach() for m in self.trainable_parameters()], decay)
        old.write()
        return float(sum(((a - b) ** 2).sum() for a, b in zip(old.master, before, strict=True)) ** 0.5)

    @contextlib.contextmanager
    def old_policy(self) -> Iterator[None]:
        """Forwards inside the block run the ``old`` policy (no gradient reaches the old weights: they never require
        one). LoRA: the ``old`` adapter is active; full fine-tune: the old working copy is swapped into the module's
        parameters (pointer swaps, no copy) and swapped back after."""
        old = self._require_old()
        if self.lora:
            self.trainable.set_adapter(OLD_ADAPTER)
            try:
                yield
            finally:
                self.trainable.set_adapter(LIVE_ADAPTER)
            return
        params = dict(self.trainable.named_parameters())
        live = [params[n] for n in self._trainable_names]
        saved = [p.data for p in live]
        try:
            for p, o in zip(live, old.working, strict=True):
                p.data = o
            yield
        finally:
            for p, d in zip(live, saved, strict=True):
                p.data = d

    def old_weights_views(self) -> dict[str, torch.Tensor]:
        """The ``old`` policy's working weights under :meth:`weights_views`' keys (no copy): what a rollout worker
        loads as its weights when the rollout samples with ``old`` (``rollout.rollout_adapter=old``)."""
        old = self._require_old()
        if self.lora:
            from peft.utils import get_peft_model_state_dict

            return {
                k: v.detach() for k, v in get_peft_model_state_dict(self.trainable, adapter_name=OLD_ADAPTER).items()
            }
        views = {k: v.detach() for k, v in self.trainable.state_dict().items()}
        views.update(zip(self._trainable_names, old.working, strict=True))
        return views

    def old_state_dict(self) -> dict[str, torch.Tensor]:
        """The old policy's fp32 masters under the live trainable parameters' names (a checkpoint's part)."""
        return {n: m.clone() for n, m in zip(self._trainable_names, self._require_old().master, strict=True)}

    def load_old_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        old = self._require_old()
        with torch.no_grad():
            for n, m in zip(self._trainable_names, old.master, strict=True):
                m.copy_(state[n])
        old.write()

    def _require_old(self) -> OldPolicy:
        if self._old is None:
            raise RuntimeError(
                "this policy has no old policy: DiffusionNFT's or AWM's anchor (actor_rollout_ref.model."
                'policy_state_adapters=["default","old"]) is made by init_old_policy'
            )
        return self._old

    def weights_state_dict(self) -> dict[str, torch.Tensor]:
        """The trainable weights only (LoRA adapter, or the full module), masters where they exist: what a weight
        sync ships and a checkpoint keeps."""
        return {k: v.clone() for k, v in self.weights_views().items()}

    def weights_views(self) -> dict[str, torch.Tensor]:
        """The keys of :meth:`weights_state_dict`, as tensors sharing storage with the weights (no copy): what a
        bucketed sync reads from (trainer: the fp32 masters where they exist) or writes into (rollout worker: its
        working copy, in place)."""
        with self.master_weights(refresh=False):
            if self.lora:
                from peft.utils import get_peft_model_state_dict

                views = get_peft_model_state_dict(self.trainable)
            else:
                views = self.trainable.state_dict()
            return {k: v.detach() for k, v in views.items()}

    def freeze_for_inference(self, dtype: torch.dtype) -> None:
        """Make this an inference-only copy (a rollout worker): nothing requires a gradient and no optimizer, so no
        fp32 master, is ever built on it; its trainable weights are in the frozen weights' ``dtype``, the trainer's
        working copy's (a LoRA adapter included)."""
        self.trainable.requires_grad_(False)
        if not self.lora:
            self.trainable.to(dtype)
            if hasattr(self, "compute_dtype"):  # the diffusion transformer's input dtype follows its weights
                self.compute_dtype = dtype
        self._trainable_names, self._masters = [], None

    def load_weights_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with self.master_weights():  # a trainer loads its fp32 masters; the working copy is refreshed after
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
            raise RuntimeError(
                "a reference policy needs LoRA (actor_rollout_ref.model.lora_rank > 0) "
                "when actor_rollout_ref.actor.kl_loss_coef > 0"
            )
        self.trainable.disable_adapters()
        try:
            yield
        finally:
            self.trainable.enable_adapters()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's own storage: an FSDP2 (DTensor) parameter's local shard, else the tensor itself (call under
    ``torch.no_grad``: ``to_local`` then returns the shard itself)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _old_name(live_name: str) -> str:
    """The ``old`` adapter's parameter beside a live LoRA parameter (peft names them ``...lora_A.<adapter>.weight``)."""
    return live_name.replace(f".{LIVE_ADAPTER}.", f".{OLD_ADAPTER}.")


@dataclass
class OldPolicy:
    """DiffusionNFT's old policy: the tensors its forwards compute with (``working``: the ``old`` adapter's parameters,
    or a full fine-tune's copy, in the compute dtype) and their fp32 masters, which the EMA updates."""

    working: list[torch.Tensor]
    master: list[torch.Tensor]

    def write(self) -> None:
        with torch.no_grad():
            for w, m in zip(self.working, self.master, strict=True):
                w.copy_(m)
