"""Data-parallel training across the actor ranks: the process group, the split of a batch, the loss weighting,
the gradient sync (explicit all-reduce for LoRA, FSDP2 for a full fine-tune) and the one-writer checkpoints.

How a mini-batch becomes one optimizer step of the whole group:

1. The trainer hands the mini-batch to the worker group; :func:`dispatch_by_groups` splits it by whole ``uid``
   groups, balanced by sample count (:func:`split_groups`, deterministic). Advantages were computed before.
2. A mini-batch's loss is a mean over its kept loss units (samples for images, response tokens for text). Each
   rank weights a micro-batch's loss by ``units_micro / units_global`` (:func:`loss_scales`: the denominator is
   all-reduced first), so the *sum* over ranks of the accumulated gradients is the single-rank gradient, however
   the ranks' valid units differ (a masked sample on one rank only changes only the counts).
3. Gradients are summed across ranks: one bucketed all-reduce of the trainable (LoRA) gradients
   (:meth:`DataParallel.all_reduce_grads`), or FSDP2's reduce-scatter with the divide factor 1 (a sum) for the
   sharded full fine-tune. Every rank then clips the same norm and takes the same AdamW step, so replicated
   (LoRA) weights stay identical on every rank.

Sequence parallelism (``actor.fsdp_config.ulysses_sequence_parallel_size`` = sp, ``models.sequence_parallel``): the
``W`` ranks are ``W / sp`` data-parallel ranks of ``sp`` consecutive ranks each. The batch is split over the
data-parallel ranks and each share goes to every rank of its group (:func:`dispatch_by_groups`); one rank per group is
collected; :func:`loss_scales` counts each group's units once. Each rank's gradient then holds its tokens' part of
its group's gradient, and the same all-reduce over all ``W`` ranks sums them.

FSDP2 and generation. Forwards of a sharded module are collectives (each block all-gathers its parameters), but
a rank generates alone. After every optimizer step :func:`full_params` all-gathers the parameters once and keeps
them (``reshard_after_forward=False``), so generation and the log-prob recompute run locally on full weights;
:func:`sharded_params` drops them before the next update, which reshards after each block's forward. Cost: one
all-gather of the trainable weights per optimizer step, and the full weights resident between updates (the
optimizer state, gradients and master weights stay sharded: 12 of AdamW's 16 bytes per fp32 parameter). Inside an
update every rank runs the same number of forward/backward passes (:func:`lockstep`), padding with zero-weighted
passes, because each one is a collective.

FSDP2 precision. The module is sharded as loaded (bf16 on CUDA), then each rank upcasts *its shard* to fp32: the fp32
master weights exist only as shards, never as a whole model on one device. ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` all-gathers bf16 weights for the forwards (so :func:`full_params` keeps a bf16 copy for
generation, not the fp32 model) and reduce-scatters fp32 gradients into the fp32 shards the optimizer steps.

A failing rank (:meth:`DataParallel.failfast`). One rank raising between collectives (an OOM, a bad sample) would
leave the others inside a collective until the process group's timeout (``actor_rollout_ref.nccl_timeout``, verl's
key). Instead the first rank to fail publishes its exception in the group's store and tears its process group down;
the others' pending collectives then fail at once (gloo: the failed peer's connections close; NCCL: each rank's
watcher thread sees the published error and aborts its own communicator) and raise :class:`RankFailedError`
naming that rank and its exception. The group is unusable afterwards: the run stops, as with a dead rank.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from omni_async.modality import REF_TIME_KEY
from omni_async.trainer.atomic_files import torch_save_atomic
from omni_async.trainer.device_memory import PEAK_PREFIX

DP_INDEX_KEY = "dp_index"  # meta_info of a rank's share: its rows' indices in the dispatched batch (-1: padding)
SAMPLES_KEY = "perf/samples_per_rank"  # the most samples a rank trained on in a mini-batch
GRAD_BUCKET_ELEMENTS = 1 << 24  # gradients all-reduced in flat buckets of at most this many elements (64 MB fp32)
PROCESS_GROUP_TIMEOUT_S = 600.0  # verl's actor_rollout_ref.nccl_timeout default
ERROR_KEY = "first_failure"  # in the group's store: "<rank>\t<exception>" of the first rank that failed
ERROR_WATCH_INTERVAL_S = 0.2  # how often a rank inside a collective call looks for a peer's published failure
LORA_CKPT, FSDP_CKPT = "actor.pt", "actor_dcp"


# ---- the split (driver side, pure) ----------------------------------------------------------------------------
def split_groups(uids: Sequence[str], ranks: int) -> list[np.ndarray]:
    """Row indices per rank: whole ``uid`` groups, largest first to the rank holding the fewest samples (ties:
    lowest rank, then first appearance), each rank's rows in batch order. Deterministic."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, u in enumerate(uids):
        groups[u].append(i)
    load, rows = [0] * ranks, [[] for _ in range(ranks)]
    for u in sorted(groups, key=lambda u: -len(groups[u])):  # stable: ties keep first appearance
        r = int(np.argmin(load))
        rows[r].extend(groups[u])
        load[r] += len(groups[u])
    return [np.array(sorted(r), dtype=np.int64) for r in rows]


def shard_batch(data: Any, ranks: int) -> list[Any]:
    """Each rank's share of ``data`` (:func:`split_groups`), its original indices in ``meta_info[DP_INDEX_KEY]``.

    A rank left without a group (fewer groups than ranks) gets one padding row: a copy of row 0 with
    ``loss_mask`` False and index -1, so it still takes part in every collective and contributes nothing."""
    shares = []
    for idx in split_groups(list(data.non_tensor_batch["uid"]), ranks):
        index = idx
        if len(idx) == 0:
            idx, index = np.zeros(1, dtype=np.int64), np.full(1, -1, dtype=np.int64)
        share = data.select_idxs(idx)
        if index[0] < 0 and "loss_mask" in share.batch.keys():
            share.batch["loss_mask"] = torch.zeros_like(share.batch["loss_mask"])
        share.meta_info = {**data.meta_info, DP_INDEX_KEY: index}
        shares.append(share)
    return shares


def sequence_parallel_size(worker_group: Any) -> int:
    """The worker group's Ulysses degree (``ActorWorkerGroup.sequence_parallel_size``; 1 for any other group)."""
    return int(getattr(worker_group, "sequence_parallel_size", 1))


def dispatch_by_groups(worker_group: Any, *args, **kwargs):
    """verl dispatch function: every ``DataProto`` argument split by :func:`shard_batch` over the data-parallel
    ranks, each share given to the ``sp`` consecutive ranks of its sequence-parallel group
    (``models.sequence_parallel``); the rest replicated."""
    from verl import DataProto  # here: the rest of this module serves the Ray-free core (trainer.actor_core) too

    n, sp = worker_group.world_size, sequence_parallel_size(worker_group)

    def split(a):
        return [s for s in shard_batch(a, n // sp) for _ in range(sp)] if isinstance(a, DataProto) else [a] * n

    return tuple(split(a) for a in args), {k: split(v) for k, v in kwargs.items()}


def rows_result(data: Any, value: torch.Tensor | dict[str, torch.Tensor]) -> tuple[np.ndarray, Any]:
    """What a rank returns for per-row results: its rows' indices in the dispatched batch, and the values (a tensor,
    or a dict of tensors with one row per batch row)."""
    return np.asarray(data.meta_info.get(DP_INDEX_KEY, np.arange(len(data)))), value


def collect_rows(worker_group: Any, outputs: list[tuple[np.ndarray, Any]]) -> torch.Tensor | dict[str, torch.Tensor]:
    """verl collect function: the ranks' per-row results back in the dispatched batch's order (padding dropped; one
    rank per sequence-parallel group, whose ranks return the same rows); a dict of tensors is collected key by key."""
    outputs = outputs[:: sequence_parallel_size(worker_group)]
    if isinstance(outputs[0][1], dict):
        return {k: collect_rows(None, [(idx, v[k]) for idx, v in outputs]) for k in outputs[0][1]}
    n = sum(int((idx >= 0).sum()) for idx, _ in outputs)
    first = outputs[0][1]
    out = first.new_empty((n, *first.shape[1:]))
    for idx, value in outputs:
        keep = idx >= 0
        out[torch.as_tensor(idx[keep])] = value[torch.as_tensor(keep)]
    return out


# Metrics that are the same on every rank (taken from rank 0), summed wall times (the slowest rank's).
SHARED_METRICS = ("actor/grad_norm", "actor/skipped_steps")


def merge_rank_metrics(outputs: list[dict[str, list[float]]], time_keys: Sequence[str] = ()) -> dict[str, float]:
    """One mini-batch's metrics from every rank's raw lists: a loss metric is the mean over all ranks' entries (as
    one rank would report the same micro-batches), a wall time the slowest rank's total, the optimizer's own
    numbers rank 0's, :data:`SAMPLES_KEY` the most loaded rank's."""
    out: dict[str, float] = {}
    for k in outputs[0]:
        values = [o.get(k, []) for o in outputs]
        if k in time_keys:
            out[k] = float(max(np.sum(v) for v in values))
        elif k in SHARED_METRICS:
            out[k] = float(np.mean(values[0]))
        elif k == SAMPLES_KEY:
            out[k] = float(max(np.sum(v) for v in values))
        elif k.startswith(PEAK_PREFIX):  # trainer.device_memory's peaks: the fullest rank's
            out[k] = float(max(x for v in values for x in v))
        else:
            flat = [x for v in values for x in v]
            if flat:
                out[k] = float(np.mean(flat))
    return out


def collect_metrics(worker_group: Any, outputs: list[dict[str, list[float]]]) -> dict[str, float]:
    """verl collect function of ``update_minibatch``: :func:`merge_rank_metrics` (``timing_s/ref`` a wall time) of
    one rank per sequence-parallel group (its ranks computed the same losses)."""
    return merge_rank_metrics(outputs[:: sequence_parallel_size(worker_group)], time_keys=(REF_TIME_KEY,))


# ``register(dispatch_mode=...)`` of the actor's data-parallel methods: per-row results, or one mini-batch's metrics.
BY_GROUPS_ROWS = {"dispatch_fn": dispatch_by_groups, "collect_fn": collect_rows}
BY_GROUPS_METRICS = {"dispatch_fn": dispatch_by_groups, "collect_fn": collect_metrics}


def trained_samples(data: Any) -> float:
    """Real (not padding) samples in a rank's share."""
    return float((np.asarray(data.meta_info.get(DP_INDEX_KEY, np.arange(len(data)))) >= 0).sum())


# ---- the group (worker side) ----------------------------------------------------------------------------------
class RankFailedError(RuntimeError):
    """Another actor rank failed while this one was in a collective call with it; names that rank's exception."""


class _ErrorWatch:
    """While a collective call runs: polls the store for a published failure and calls ``on_error`` once (NCCL:
    abort this rank's communicator, which ends a collective still waiting for the failed peer)."""

    def __init__(self, store: dist.Store, on_error: Callable[[], None], interval_s: float = ERROR_WATCH_INTERVAL_S):
        self.store, self.on_error, self.interval_s = store, on_error, interval_s
        self.stopped = threading.Event()
        self.fired = False
        self.thread = threading.Thread(target=self._run, name="dp-error-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                found = self.store.check([ERROR_KEY])
            except Exception:  # the store's host (rank 0) is gone: the collective fails by itself
                return
            if found and not self.stopped.is_set():
                self.fired = True
                self.on_error()
                return

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


class DataParallel:
    """This actor rank's view of the data-parallel group, from the environment verl's ``RayWorkerGroup`` gives
    each worker (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): ``nccl`` on CUDA (bound to this rank's
    device), ``gloo`` on CPU; ``timeout_s`` bounds every collective (``actor_rollout_ref.nccl_timeout``). With one
    rank nothing is initialised and every collective is the identity. ``sp``: the Ulysses degree
    (``models.sequence_parallel``); rank ``r`` is data-parallel rank ``r // sp`` of ``world // sp``, and the ``sp``
    ranks of a group train on the same samples."""

    def __init__(self, device: str = "cpu", timeout_s: float = PROCESS_GROUP_TIMEOUT_S, sp: int = 1):
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.sp = int(sp)
        if self.sp < 1 or self.world % self.sp:
            raise ValueError(
                f"actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size={sp} does not divide the "
                f"{self.world} actor ranks: set it to a divisor of trainer.n_gpus_per_node x trainer.nnodes"
            )
        self.device = torch.device(device)
        self.sharded = False  # set by shard_module (FSDP2 full fine-tune)
        self.store: dist.Store | None = None  # where a failing rank publishes its error (failfast)
        self.failure: tuple[int, str] | None = None  # (rank, exception) once the group failed
        if self.world > 1 and not dist.is_initialized():
            timeout = timedelta(seconds=float(timeout_s))
            # Our own handle on the rendezvous store (the one init_process_group would make from the same env).
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), self.world, self.rank == 0, timeout=timeout
            )
            cuda = self.device.type == "cuda"
            dist.init_process_group(
                "nccl" if cuda else "gloo",
                store=store,
                rank=self.rank,
                world_size=self.world,
                timeout=timeout,
                **({"device_id": self.device} if cuda else {}),
            )
            self.store = dist.PrefixStore("omni_async_dp", store)

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def sp_rank(self) -> int:
        """This rank's place in its sequence-parallel group (0: the one whose rows and metrics are collected)."""
        return self.rank % self.sp

    # ---- a failing rank -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def failfast(self, what: str) -> Iterator[None]:
        """Around a call that runs collectives on every rank (an update, a log-prob recompute, a checkpoint): if
        this rank raises first, it publishes the exception and tears the group down; if a peer failed first, this
        rank's failed collective becomes :class:`RankFailedError` naming the peer and its exception."""
        if not self.active or self.store is None:
            yield
            return
        if self.failure is not None:
            raise self._peer_error(what)
        watch = _ErrorWatch(self.store, self._abort) if self.device.type == "cuda" else None
        try:
            yield
        except BaseException as e:
            if watch is not None:
                watch.stop()
            first = self._publish(f"{type(e).__name__}: {str(e).strip()[:2000]}")
            self.failure = first
            if first[0] != self.rank:
                raise self._peer_error(what) from e
            self._abort()
            raise
        finally:
            if watch is not None:
                watch.stop()

    def _publish(self, error: str) -> tuple[int, str]:
        """Record this rank's failure unless a peer's is already there; return the first one."""
        first = self.store.compare_set(ERROR_KEY, "", f"{self.rank}\t{error}").decode()
        rank, _, message = first.partition("\t")
        return int(rank), message

    def _peer_error(self, what: str) -> RankFailedError:
        rank, message = self.failure
        who = "earlier" if rank == self.rank else f"while rank {self.rank} waited for it in {what}"
        return RankFailedError(
            f"actor rank {rank} failed {who}: {message}. The process group is torn down: fix the "
            "cause and resume from the last checkpoint (trainer.resume_mode=auto)"
        )

    def _abort(self) -> None:
        """Tear this rank's process group down so pending collectives end now. NCCL: ``_abort_process_group``
        (a destroy would wait for the stuck kernels); gloo: closing the connections fails the peers' reads."""
        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()

    # ---- collectives ----------------------------------------------------------------------------------------
    def sum(self, x: float) -> float:
        if not self.active:
            return float(x)
        t = torch.tensor([float(x)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item())

    def max(self, x: float) -> float:
        if not self.active:
            return float(x)
        t = torch.tensor([float(x)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def broadcast_(self, params: Sequence[torch.Tensor]) -> None:
        """Rank 0's values into every rank's tensors (the initial LoRA weights: one starting point)."""
        if self.active:
            for flat, group in _buckets(list(params)):
                dist.broadcast(flat, src=0)
                _unflatten_into(flat, group)

    def all_reduce_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum every trainable gradient over the ranks (bucketed; a rank without a gradient sends zeros)."""
        if not self.active:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for flat, grads in _buckets([p.grad for p in params]):
            dist.all_reduce(flat)
            _unflatten_into(flat, grads)

    def barrier(self) -> None:
        if self.active:
            dist.barrier()


def _buckets(tensors: list[torch.Tensor]):
    """Flat copies of consecutive same-dtype tensors, at most :data:`GRAD_BUCKET_ELEMENTS` elements each."""
    group: list[torch.Tensor] = []
    for t in tensors:
        if group and (group[0].dtype != t.dtype or sum(g.numel() for g in group) + t.numel() > GRAD_BUCKET_ELEMENTS):
            yield torch.cat([g.reshape(-1) for g in group]), group
            group = []
        group.append(t)
    if group:
        yield torch.cat([g.reshape(-1) for g in group]), group


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.data.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


# ---- the loss weighting ---------------------------------------------------------------------------------------
def loss_scales(units: Sequence[float], dp: DataParallel | None) -> list[float]:
    """Each micro-batch's loss weight: its loss units over the mini-batch's units on *all* ranks (all-reduced, each
    sequence-parallel group's once: its ``sp`` ranks hold the same samples), so the gradients summed over
    micro-batches and ranks are the gradient of the whole mini-batch's mean loss."""
    local = float(sum(units))
    total = dp.sum(local) / dp.sp if dp is not None else local
    return [float(n) / total if total > 0 else 0.0 for n in units]


def lockstep(micro: list[Any], scales: list[float], dp: DataParallel) -> tuple[list[Any], list[float]]:
    """FSDP2: every rank runs as many micro-batches as the busiest one (each pass is a collective); the extra
    ones repeat the rank's first micro-batch at weight 0. Each pass also has as many rows on every rank as its
    largest micro-batch on any rank (:func:`pad_rows`): a diffusion policy calls the transformer once per sample in
    the SDE window (``models.diffusion_policy``), so the count of collectives follows the rows."""
    n = int(dp.max(len(micro)))
    pad = n - len(micro)
    micro = micro + [micro[0]] * pad
    return [pad_rows(mb, int(dp.max(len(mb)))) for mb in micro], list(scales) + [0.0] * pad


def pad_rows(data: Any, rows: int) -> Any:
    """``data`` (a ``DataProto`` with ``loss_mask``) grown to ``rows`` rows by copies of its first row outside the
    loss (``loss_mask`` False): they run forward and backward and contribute nothing."""
    extra = rows - len(data)
    if extra <= 0:
        return data
    out = data.select_idxs(np.concatenate([np.arange(len(data)), np.zeros(extra, dtype=np.int64)]))
    mask = out.batch["loss_mask"].clone()
    mask[len(data) :] = False
    out.batch["loss_mask"] = mask
    return out


# ---- FSDP2 (full fine-tune) -----------------------------------------------------------------------------------
def fsdp_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def shard_module(module: torch.nn.Module, dp: DataParallel, compute_dtype: torch.dtype | None = None) -> None:
    """FSDP2 (``fully_shard``) on each transformer block (the model's ``_no_split_modules``), then the root, over
    all ranks; gradients reduce-scattered as a sum (the loss is already weighted by :func:`loss_scales`). The module
    comes in as loaded (its weights in ``compute_dtype``, bf16 on CUDA): forwards all-gather ``compute_dtype``
    weights and gradients reduce in fp32 (``MixedPrecisionPolicy``), and each rank's shard is upcast to fp32 only
    after sharding, so no rank ever holds the whole model in fp32. Leaves the module sharded: build the optimizer
    over its (sharded, fp32) parameters, then gather them with :func:`full_params`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from omni_async.models.lora import dominant_dtype

    compute = compute_dtype or dominant_dtype(module)
    # Inputs are left as the caller made them (the policy casts latents and prompt encodings itself): FSDP2's
    # default cast would also round fp32 inputs the model keeps fp32 on one rank, e.g. the timestep to bf16.
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32, cast_forward_inputs=False)
    mesh = init_device_mesh(dp.device.type, (dp.world,))
    blocks = set(getattr(module, "_no_split_modules", None) or [])
    for m in list(module.modules()):
        if m is not module and type(m).__name__ in blocks:
            fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(module, mesh=mesh, mp_policy=mp)
    # The fp32 masters: each rank's own shard upcast (FSDP2 re-registers it); buffers keep their dtype.
    module._apply(lambda t: t.float() if isinstance(t, DTensor) and t.is_floating_point() else t)
    for m in fsdp_modules(module):
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    dp.sharded = True


def full_params(module: torch.nn.Module) -> None:
    """All-gather the (fresh) parameters and keep them: forwards then run locally (generation, log-probs) on the
    gathered compute-dtype copy (bf16 on CUDA; the fp32 masters stay sharded). A collective: every rank calls it at
    the same point."""
    mods = fsdp_modules(module)
    for m in mods:
        m.reshard()  # drop a stale gathered copy: the optimizer step updated the shards
    module.set_reshard_after_forward(False)
    for m in mods:
        m.unshard()


def sharded_params(module: torch.nn.Module) -> None:
    """Drop the gathered parameters; training forwards gather block by block and reshard after each."""
    for m in fsdp_modules(module):
        m.reshard()
    module.set_reshard_after_forward(True)


def local_state_dict(module: torch.nn.Module, clone: bool = True) -> dict[str, torch.Tensor]:
    """The module's full weights on this rank without a collective: while :func:`full_params` holds them, the
    parameters registered on the module are the gathered tensors. (Not ``state_dict()``: FSDP2's hook gives the
    shards and frees the gathered storage under the registered parameters.) Keys as ``state_dict``'s.
    ``clone=False``: the tensors themselves (read in place by a bucketed weight sync)."""

    def own(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone() if clone else t.detach()

    out = {k: own(p) for k, p in module.named_parameters(remove_duplicate=False)}
    for name, m in module.named_modules(remove_duplicate=False):
        for b, buf in m._buffers.items():
            if buf is not None and b not in m._non_persistent_buffers_set:
                out[f"{name}.{b}" if name else b] = own(buf)
    return out


def grad_norm_value(norm: torch.Tensor) -> torch.Tensor:
    """``clip_grad_norm_``'s total norm as a plain tensor (a replicated DTensor for FSDP2 parameters)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


# ---- checkpoints ----------------------------------------------------------------------------------------------
def save_actor(path: str | Path, policy: Any, optimizer: torch.optim.Optimizer, dp: DataParallel) -> None:
    """One checkpoint set per save. Replicated (LoRA, or one rank): rank 0 writes ``actor.pt`` (the trainable
    weights and the optimizer state, the same on every rank). Sharded (FSDP2): every rank writes its shard into one
    ``torch.distributed.checkpoint`` directory, ``actor_dcp/``. Called on every rank."""
    path = Path(path)
    if dp.sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        sharded_params(policy.trainable)
        model_state, optim_state = get_state_dict(policy.trainable, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path / FSDP_CKPT))
        full_params(policy.trainable)
    elif dp.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        state = {"weights": policy.weights_state_dict(), "optimizer": optimizer.state_dict()}
        if getattr(policy, "has_old_policy", False):  # DiffusionNFT: the old policy resumes where it was
            state["old_weights"] = policy.old_state_dict()
        torch_save_atomic(state, path / LORA_CKPT)
    dp.barrier()


def load_actor(path: str | Path, policy: Any, optimizer: torch.optim.Optimizer, dp: DataParallel) -> None:
    """Every rank reads the checkpoint: ``actor.pt`` whatever the number of ranks that wrote it (LoRA), or its
    part of ``actor_dcp/`` (``torch.distributed.checkpoint`` reshards when the rank count changed, down to one)."""
    path = Path(path)
    if (path / FSDP_CKPT).exists():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        if dp.sharded:
            sharded_params(policy.trainable)
        with policy.master_weights():  # one rank: the optimizer's fp32 masters under the module's names
            model_state, optim_state = get_state_dict(policy.trainable, optimizer)
            state = {"model": model_state, "optim": optim_state}
            dcp.load(state, checkpoint_id=str(path / FSDP_CKPT), no_dist=not dist.is_initialized())
            set_state_dict(
                policy.trainable, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
        if dp.sharded:
            full_params(policy.trainable)
        return
    if dp.sharded:
        raise ValueError(
            f"{path} holds a one-rank full fine-tune checkpoint ({LORA_CKPT}); resume it with one actor "
            "rank (trainer.n_gpus_per_node=1, trainer.nnodes=1): sharded runs write and read "
            f"{FSDP_CKPT}/"
        )
    state = torch.load(path / LORA_CKPT, weights_only=True, map_location=dp.device)
    policy.load_weights_state_dict(state["weights"])
    optimizer.load_state_dict(state["optimizer"])
    if getattr(policy, "has_old_policy", False):
        if "old_weights" in state:
            policy.load_old_state_dict(state["old_weights"])
        else:  # a checkpoint written without an old policy (verl-omni's rule at start: old = the live weights)
            policy.refresh_old(0.0)
