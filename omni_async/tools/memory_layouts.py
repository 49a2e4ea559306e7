"""Per-device memory of each worker layout, from a measured plan (:mod:`omni_async.tools.memory_plan`): what stays
resident, what each phase adds, and what the allocator and the runtime add on top.

Layouts (DESIGN, "On GPUs"), per device, in GB (1e9 bytes):

* ``hybrid`` — one process trains and generates (the default). LoRA: bf16 transformer + LoRA state (fp32 param,
  grad, AdamW ``exp_avg`` / ``exp_avg_sq``: 16 bytes per parameter) + the rollout snapshot adapter (an fp32 copy of
  the adapter, ``models.lora.snapshot_for_rollout``, made when updates overlap generation: counted unless
  ``snapshot=False``). Full fine-tune (FSDP2 over ``ranks``): fp32 master shards + fp32 gradient shards + AdamW
  state, 16 bytes per parameter / ranks; generation runs on the gathered bf16 weights (``data_parallel.full_params``,
  2 bytes per parameter, resident between updates and dropped for the update); an update gathers bf16 blocks
  one at a time (the bf16 cast of the shards that FSDP2 all-gathers) and reduce-scatters fp32 gradients.
  Rollout phase: + text encoder + VAE + the largest of (text-encoder forward, denoising forward, VAE decode).
  Update phase: + the encoders unless ``param_offload`` moves them to the CPU + the larger of (training micro-batch
  peak [+ FSDP2 block buffers], the optimizer step's transient, the LoRA gradient all-reduce bucket).
* ``rollout`` — an inference-only rollout worker (disaggregated layout): the frozen bf16 pipeline (transformer,
  text encoder, VAE) and, for LoRA, the fp32 adapter it generates with; no optimizer, gradients or training
  activations. It adds the largest of its forwards and the weight-sync receive bucket (verl's
  ``checkpoint_engine.update_weights_bucket_megabytes``, at most the synced weights' size).
* ``trainer`` — a trainer rank of the disaggregated layout: the hybrid update phase without the encoders (prompt
  encodings travel in the batch), plus the weight-sync send bucket.

Ulysses sequence parallelism (``sp`` > 1, LoRA layouts only, as the trainer's config allows): the training micro-batch
is one rank's of its group, measured with the tokens split (``train_sp``); with ``split_generation`` (a hybrid
group that generates together: ``rollout.agent.num_workers`` one per group) the denoising forward is one rank's too
(``rollout_sp``), else each rank generates whole samples; everything else a rank holds is unchanged (a full bf16
transformer and the LoRA state on every rank, the gradient all-reduce over all ranks, the text encoder's forward and
the VAE decode), and the group's two communicators (the all-to-all Ulysses group and the ring x Ulysses group the output is
gathered over) add :data:`NCCL_RESERVE_GB` each.

On top of the allocated peak (assumptions, not measurements — the plan runs no GPU):

* :data:`FRAGMENTATION` of the allocated peak: reserved-but-unallocated memory of PyTorch's caching allocator;
* :data:`RUNTIME_RESERVE_GB`: the CUDA context and cuBLAS / cuDNN workspaces;
* :data:`NCCL_RESERVE_GB` per NCCL communicator the worker holds (the data-parallel group when ``ranks > 1``; the
  weight-sync group of the disaggregated layout): NCCL allocates its own buffers outside PyTorch's allocator,
  ``NCCL_BUFFSIZE`` (4 MiB) per protocol, channel and peer, up to 32 channels on NVLink.

A configuration fits a device when the total is at most its capacity *as sold*: 80 GB = 80e9 bytes for an
"H100 80GB" (it reports about 85e9; the difference is left as margin, not counted as usable).
"""

from __future__ import annotations

GB = 1e9
RUNTIME_RESERVE_GB = 1.5  # assumption: CUDA context + cuBLAS / cuDNN workspaces
NCCL_RESERVE_GB = 1.0  # assumption: one NCCL communicator's buffers (outside PyTorch's allocator)
FRAGMENTATION = 0.10  # assumption: reserved-but-unallocated share of the caching allocator, of the allocated peak
DEVICES_GB = {"H100 80GB": 80.0, "H200 141GB": 141.0}  # as sold: 80e9 / 141e9 bytes
LORA_STATE_BYTES = 16  # fp32 param + grad + AdamW exp_avg + exp_avg_sq, per LoRA parameter
ADAPTER_BYTES = 4  # an fp32 copy of the adapter: the hybrid rollout snapshot, or a rollout worker's adapter
FULL_SHARD_BYTES = 16  # fp32 master + fp32 grad + AdamW (2 x fp32) per parameter, sharded over the ranks
BF16_BYTES = 2
VERL_WEIGHTS_BUCKET_GB = (2048 << 20) / GB  # verl's rollout.checkpoint_engine.update_weights_bucket_megabytes default
LAYOUTS = ("hybrid", "rollout", "trainer")
SP_COMMUNICATORS = 2  # a Ulysses group's: diffusers' ulysses mesh (all-to-all) and its flattened ring x ulysses mesh


def train_figures(entry: dict, full: bool = False, sp: int = 1) -> dict:
    """The measured training micro-batches of one resolution of a plan, by ``"{cfg}/{ckpt}"`` key: the full
    fine-tune's (``train_full``), one Ulysses rank's of degree ``sp`` (``train_sp``), else LoRA's (``train``)."""
    if sp > 1 and full:
        raise ValueError(
            f"sp={sp} with full=True: Ulysses sequence parallelism runs with LoRA only here (the trainer refuses "
            "ulysses_sequence_parallel_size > 1 with a full fine-tune); plan the full fine-tune at sp=1"
        )
    if sp > 1:
        return entry.get("train_sp", {}).get(str(sp), {})
    return entry.get("train_full" if full else "train", {})


def device_peak(
    plan: dict,
    res: int,
    cfg: bool,
    ckpt: bool,
    offload_encoders: bool,
    micro_scale: float = 1.0,
    vae_tiled: bool | None = None,
    layout: str = "hybrid",
    full: bool = False,
    ranks: int = 1,
    snapshot: bool = True,
    weights_bucket_gb: float = VERL_WEIGHTS_BUCKET_GB,
    sp: int = 1,
    split_generation: bool = False,
) -> dict:
    """One device of ``layout`` (module docstring): the allocated peak of each phase and the device total, in GB.

    ``micro_scale`` scales the measured training activations linearly (they are proportional to the micro-batch);
    the rollout phase stays at the measured batch (``agent.max_batch_size`` requests, x2 with CFG).
    ``vae_tiled=None`` follows the policy's default (tiled for video, plain for images). ``sp``: the Ulysses degree
    (module docstring; ``ranks`` counts every actor rank, a multiple of ``sp``); ``split_generation``: the hybrid
    group generates together (one rank's denoising forward, ``rollout_sp``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: use one of {LAYOUTS}")
    if sp > 1 and (ranks % sp or layout == "rollout"):
        raise ValueError(
            f"sp={sp} with layout={layout!r}, ranks={ranks}: Ulysses splits the update of {sp} actor ranks; use a "
            f"hybrid or trainer layout with ranks a multiple of {sp}"
        )
    w, entry = plan["weights"], plan["resolutions"][str(res)]
    tag = "cfg" if cfg else "no_cfg"
    key = f"{tag}/{'ckpt' if ckpt else 'no_ckpt'}"
    transformer = w["transformer"]["gb"]
    encoders = sum(part["gb"] for name, part in w.items() if name != "transformer")  # text encoder(s) and VAE
    tiled = plan["frames"] > 1 if vae_tiled is None else vae_tiled
    denoise = entry["rollout_gb"][tag]
    if split_generation:
        if sp < 2 or layout != "hybrid":
            raise ValueError(f"split_generation with sp={sp}, layout={layout!r}: only a hybrid Ulysses group (sp > 1)")
        if tag not in entry.get("rollout_sp", {}).get(str(sp), {}):
            raise ValueError(f"{tag} generation at {res}² (sp={sp}) is not in the plan: measure it (memory_plan --sp)")
        denoise = entry["rollout_sp"][str(sp)][tag]
    generate = max(plan["text_encoder_forward_gb"], denoise, entry["vae_decode_gb"]["tiled" if tiled else "plain"])
    trains = layout != "rollout"  # a rollout worker reads no training figure
    if trains and key not in train_figures(entry, full, sp):
        raise ValueError(f"{key} at {res}² (sp={sp}, full={full}) is not in the plan: measure it (memory_plan --sp)")
    train_peak = train_figures(entry, full, sp)[key]["peak_gb"] * micro_scale if trains else 0.0
    if full:
        params = plan["full"]["params"]
        state = FULL_SHARD_BYTES * params / ranks / GB
        train = (train_peak + (plan["full"]["fsdp_buffers_gb"] if ranks > 1 else 0.0)) if trains else 0.0
        step = plan["full"]["optimizer_step_gb"] / ranks
        synced = BF16_BYTES * params / GB  # what a weight sync moves (the rollout's dtype)
        adapter = 0.0
    else:
        params = plan["lora"]["params"]
        state = LORA_STATE_BYTES * params / GB
        train = train_peak
        step = max(plan["optimizer_step_gb"], plan["lora_allreduce_bucket_gb"] if ranks > 1 else 0.0)
        synced = adapter = ADAPTER_BYTES * params / GB
    bucket = min(weights_bucket_gb, synced)
    if layout == "hybrid":
        if full:  # generation on the gathered bf16 weights; the update on shards, block by block
            rollout = state + transformer + encoders + generate
            update = state + (0.0 if offload_encoders else encoders) + max(train, step)
        else:
            resident = transformer + state + (adapter if snapshot else 0.0)
            rollout = resident + encoders + generate
            update = resident + (0.0 if offload_encoders else encoders) + max(train, step)
        communicators = 1 if ranks > 1 else 0
    elif layout == "rollout":
        rollout = transformer + adapter + encoders + max(generate, bucket)
        update = 0.0
        communicators = 1  # the weight-sync group
    else:  # trainer rank of the disaggregated layout
        rollout = 0.0
        update = (state if full else transformer + state) + max(train, step, bucket)
        communicators = 1 + (1 if ranks > 1 else 0)  # weight-sync group (+ data-parallel group)
    communicators += SP_COMMUNICATORS if sp > 1 else 0
    allocated = max(rollout, update)
    fragmentation = FRAGMENTATION * allocated
    runtime = RUNTIME_RESERVE_GB + communicators * NCCL_RESERVE_GB
    return {
        "rollout_gb": rollout,
        "update_gb": update,
        "allocated_gb": allocated,
        "fragmentation_gb": fragmentation,
        "runtime_gb": runtime,
        "peak_gb": allocated + fragmentation + runtime,
    }


def rollout_worker_peak(plan: dict, res: int, cfg: bool, vae_tiled: bool | None = None, full: bool = False) -> float:
    """Device total of an inference-only rollout worker (disaggregated layout), in GB: :func:`device_peak` with
    ``layout="rollout"``."""
    return device_peak(plan, res, cfg, True, False, vae_tiled=vae_tiled, layout="rollout", full=full)["peak_gb"]


def recommend(plan: dict, capacity_gb: float, cfg: bool = True, **layout) -> dict:
    """Per resolution: every (checkpointing, encoder offload) option whose device total fits ``capacity_gb``, with
    its largest micro-batch (training activations scaled linearly from the measured one), and the pick: the first
    that fits in the order no-checkpointing/no-offload, no-checkpointing/offload, checkpointing/no-offload,
    checkpointing/offload (recomputing every block costs about one extra forward per update; offloading costs two
    host<->device copies of the encoders per step). ``layout``: :func:`device_peak`'s layout keywords."""
    out = {}
    for res in plan["resolutions"]:
        options = []
        measured = train_figures(plan["resolutions"][res], layout.get("full", False), layout.get("sp", 1))
        for ckpt, offload in ((False, False), (False, True), (True, False), (True, True)):
            if f"{'cfg' if cfg else 'no_cfg'}/{'ckpt' if ckpt else 'no_ckpt'}" not in measured:
                continue  # not measured
            micro = 0
            while (
                micro < 256
                and device_peak(plan, int(res), cfg, ckpt, offload, micro + 1, **layout)["peak_gb"] <= capacity_gb
            ):
                micro += 1
            if micro:
                peak = device_peak(plan, int(res), cfg, ckpt, offload, **layout)["peak_gb"]
                options.append(
                    {
                        "gradient_checkpointing": ckpt,
                        "offload_encoders_during_update": offload,
                        "max_micro_batch": micro * plan["micro_batch"],
                        f"peak_gb_at_micro_batch_{plan['micro_batch']}": round(peak, 1),
                    }
                )
        out[res] = {"pick": options[0] if options else None, "options": options}
    return out


def layout_rows(plan: dict, ranks: tuple[int, ...] = (4, 8)) -> dict:
    """The recipe's settings (CFG as the plan's ``cfg``: on, off for a guidance-distilled FLUX.1-dev; checkpointing
    on, encoders on the GPU, micro-batch as measured) in every layout, per resolution: ``{row: {res:
    device_peak(...)}}``. Each measured Ulysses degree ``n`` adds hybrid and trainer-rank LoRA rows on ``n`` ranks
    (one group), and where its generation was measured a hybrid row of a group that generates together."""
    cfg = plan.get("cfg", True)
    key = f"{'cfg' if cfg else 'no_cfg'}/ckpt"
    rows = {
        "hybrid LoRA": {"layout": "hybrid"},
        "rollout worker LoRA": {"layout": "rollout"},
        "trainer rank LoRA": {"layout": "trainer"},
    }
    if "full" in plan:
        rows["rollout worker full"] = {"layout": "rollout", "full": True}
        for n in ranks:
            rows[f"hybrid full x{n}"] = {"layout": "hybrid", "full": True, "ranks": n}
            rows[f"trainer rank full x{n}"] = {"layout": "trainer", "full": True, "ranks": n}
    for n in sorted({int(n) for entry in plan["resolutions"].values() for n in entry.get("train_sp", {})}):
        rows[f"hybrid LoRA sp{n}"] = {"layout": "hybrid", "ranks": n, "sp": n}
        if all(str(n) in entry.get("rollout_sp", {}) for entry in plan["resolutions"].values()):
            rows[f"hybrid LoRA sp{n}, generation split"] = {
                "layout": "hybrid",
                "ranks": n,
                "sp": n,
                "split_generation": True,
            }
        rows[f"trainer rank LoRA sp{n}"] = {"layout": "trainer", "ranks": n, "sp": n}
    out = {}
    for name, kw in rows.items():
        out[name] = {
            res: device_peak(plan, int(res), cfg, True, False, **kw)
            for res, entry in plan["resolutions"].items()
            if kw["layout"] == "rollout" or key in train_figures(entry, kw.get("full", False), kw.get("sp", 1))
        }
    return out
