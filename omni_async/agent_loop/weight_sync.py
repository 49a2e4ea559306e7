"""Weight sync across pools (disaggregated layout, ``checkpoint_engine.backend=nccl``): trainer rank 0 broadcasts
its trainable weights to the rollout workers over a ``torch.distributed`` group of its own.

The group spans trainer rank 0 (group rank 0) and every rollout worker (ranks 1..R). It is not the default process
group (trainer rank 0 already belongs to the data-parallel one, and the rollout workers to none): it is built from a
``TCPStore`` on rank 0's node and a process-group object (``ProcessGroupNCCL`` on CUDA, ``ProcessGroupGloo`` on CPU),
the way verl's / vLLM's stateless groups are, so several can exist in one process and a broken one can be replaced.

What moves: the tensors named by the receivers' metadata (:func:`tensor_meta` of the rollout worker's trainable
weights: the LoRA adapter, or the whole transformer / LM for a full fine-tune), each cast to the receiver's dtype
(``model_dtype`` for a full fine-tune: bf16 on CUDA), packed into flat buckets of at most
``update_weights_bucket_megabytes`` (:func:`plan_buckets`; a tensor larger than a bucket is split across several),
one broadcast per bucket. Sender and receivers derive the same plan from the same metadata, so only tensor bytes
travel. Memory on either side is one bucket plus the weights themselves: the sender reads its parameters in place.
A receiver whose whole set fits one bucket (a LoRA adapter; :func:`fits_one_bucket`) receives it on a thread of its
own while it goes on generating and keeps the bucket as a staged set, written into its parameters between two device
batches (:func:`write_buckets`, ``agent_loop.weight_staging``); a larger set (a full fine-tune) is copied bucket by
bucket straight into the parameters on the device thread, so generation pauses for the transfer. Either way no
generation batch runs while the weights are half written (and a failed in-place transfer leaves the worker refusing
to generate until a complete set arrives; a failed staged one leaves its weights as they were).

Logging: a member joining its group is INFO; each transfer (bytes, buckets, seconds) is DEBUG here, since the rollout
worker logs the set it received at INFO (``rollout_replica``) and a sync runs every step.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 600.0  # a broadcast waits this long for every member (a bucket of 2 GB on a slow link included)
DTYPES = {
    str(d): d
    for d in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.bool,
    )
}

Meta = list[tuple[str, tuple[int, ...], str]]  # (name, shape, dtype name) per tensor, in send order


def tensor_meta(tensors: dict[str, torch.Tensor]) -> Meta:
    return [(k, tuple(int(s) for s in t.shape), str(t.dtype)) for k, t in tensors.items()]


def meta_bytes(meta: Meta) -> int:
    """Bytes one sync moves: every tensor of ``meta`` in its dtype."""
    return sum(int(torch.Size(shape).numel()) * DTYPES[d].itemsize for _, shape, d in meta)


@dataclass
class Piece:
    name: str
    lo: int  # element range of the flattened tensor
    hi: int
    offset: int  # where it sits in the bucket


@dataclass
class Bucket:
    dtype: torch.dtype
    numel: int
    pieces: list[Piece]


def plan_buckets(meta: Meta, bucket_bytes: int) -> list[Bucket]:
    """Consecutive tensors of one dtype packed into buckets of at most ``bucket_bytes``; a tensor that does not fit
    the current bucket's room continues in the next. Deterministic: both sides compute the same plan."""
    buckets: list[Bucket] = []
    cur: Bucket | None = None
    for name, shape, d in meta:
        dtype = DTYPES[d]
        cap = max(1, int(bucket_bytes) // dtype.itemsize)
        n, lo = int(torch.Size(shape).numel()), 0
        while lo < n:
            if cur is None or cur.dtype != dtype or cur.numel >= cap:
                cur = Bucket(dtype, 0, [])
                buckets.append(cur)
            take = min(n - lo, cap - cur.numel)
            cur.pieces.append(Piece(name, lo, lo + take, cur.numel))
            cur.numel += take
            lo += take
    return buckets


def free_address() -> tuple[str, int]:
    """This node's address and a free TCP port, for the group's store (called on group rank 0)."""
    import ray

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), int(port)


class WeightGroup:
    """One member of the trainer-rank-0 + rollout-workers group; rank 0 sends."""

    def __init__(
        self, address: str, port: int, rank: int, world: int, device: torch.device, timeout_s: float = GROUP_TIMEOUT_S
    ):
        self.rank, self.world, self.device = int(rank), int(world), torch.device(device)
        t0 = time.perf_counter()
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(address, int(port), self.world, self.rank == 0, timeout=timeout)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(self.store, self.rank, self.world, opts)
            self.backend = "nccl"
        else:
            self.pg = dist.ProcessGroupGloo(self.store, self.rank, self.world, timeout)
            self.backend = "gloo"
        logger.info(
            "joined the weight-sync group at %s:%s as rank %d of %d (%s on %s) in %.1fs",
            address,
            port,
            self.rank,
            self.world,
            self.backend,
            self.device,
            time.perf_counter() - t0,
        )

    def _broadcast(self, flat: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([flat], opts).wait()

    def send(self, tensors: dict[str, torch.Tensor], meta: Meta, bucket_bytes: int, keep: list | None = None) -> int:
        """Rank 0: every tensor of ``meta`` from ``tensors`` (read in place), cast to the metadata's dtype. ``keep``:
        a list the sent buckets are appended to (the set as sent, for :meth:`send_buckets` later)."""
        sent, t0 = 0, time.perf_counter()
        flats = {k: t.detach().reshape(-1) for k, t in tensors.items()}
        missing = [name for name, _, _ in meta if name not in flats]
        if missing:
            raise KeyError(f"the trainer has no weights named {missing[:3]}: rollout and trainer models differ")
        for b in plan_buckets(meta, bucket_bytes):
            flat = torch.empty(b.numel, dtype=b.dtype, device=self.device)
            for p in b.pieces:
                flat[p.offset : p.offset + p.hi - p.lo].copy_(flats[p.name][p.lo : p.hi])
            if keep is not None:  # before the broadcast: kept even when a receiver dies during it
                keep.append(flat)
            self._broadcast(flat)
            sent += flat.numel() * flat.element_size()
        _debug("sent", sent, len(plan_buckets(meta, bucket_bytes)), t0)
        return sent

    def send_buckets(self, flats: list[torch.Tensor]) -> int:
        """Rank 0: buckets kept from an earlier :meth:`send`, broadcast again as they are."""
        for flat in flats:
            self._broadcast(flat)
        return sum(flat.numel() * flat.element_size() for flat in flats)

    def receive(self, dest: dict[str, torch.Tensor], meta: Meta, bucket_bytes: int) -> int:
        """Ranks > 0: each bucket copied straight into ``dest`` (tensors sharing storage with the parameters)."""
        got, t0, buckets = 0, time.perf_counter(), plan_buckets(meta, bucket_bytes)
        for b in buckets:
            flat = torch.empty(b.numel, dtype=b.dtype, device=self.device)
            self._broadcast(flat)
            write_buckets(dest, [(b, flat)])
            got += flat.numel() * flat.element_size()
        _debug("received and written in place", got, len(buckets), t0)
        return got

    def receive_buckets(self, meta: Meta, bucket_bytes: int) -> list[tuple[Bucket, torch.Tensor]]:
        """Ranks > 0: every bucket into buffers of its own (a staged set; :func:`write_buckets` applies it)."""
        received, t0 = [], time.perf_counter()
        for b in plan_buckets(meta, bucket_bytes):
            flat = torch.empty(b.numel, dtype=b.dtype, device=self.device)
            self._broadcast(flat)
            received.append((b, flat))
        _debug("received to stage", sum(f.numel() * f.element_size() for _, f in received), len(received), t0)
        return received


def _debug(what: str, nbytes: int, buckets: int, t0: float) -> None:
    logger.debug("weights %s: %.1f MB in %d bucket(s), %.3fs", what, nbytes / 2**20, buckets, time.perf_counter() - t0)


def fits_one_bucket(meta: Meta, bucket_bytes: int) -> bool:
    """Whether a sync of ``meta`` is one bucket: then a receiver can stage it (hold it beside its weights) at no more
    memory than an in-place transfer takes anyway."""
    return len(plan_buckets(meta, bucket_bytes)) <= 1


def write_buckets(dest: dict[str, torch.Tensor], received: list[tuple[Bucket, torch.Tensor]]) -> int:
    """Copy received buckets into ``dest`` (tensors sharing storage with the parameters); returns the bytes."""
    flats = {k: t.view(-1) for k, t in dest.items()}
    for b, flat in received:
        for p in b.pieces:
            flats[p.name][p.lo : p.hi].copy_(flat[p.offset : p.offset + p.hi - p.lo])
    return sum(flat.numel() * flat.element_size() for _, flat in received)
