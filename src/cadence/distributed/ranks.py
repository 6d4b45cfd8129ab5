"""Several processes: PyTorch's own torch.distributed (launched by torchrun), DDP or FSDP2, and what the step chain
needs from them.

cadence never builds its own communication: DDP (``DistributedDataParallel``) or FSDP2 (``fully_shard``) move the
gradients, and this module only decides WHEN (``Collective.gradient_sync``: once per window, entered before the last
micro-batch's forward) and adds the one small all-reduce the normalisation needs (the window's target count, summed
over ranks, so that any split micro x accum x world gives the gradient of one big batch).

Configuration comes from the command line; the only environment variables read are torchrun's (``torchrun.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from cadence.config import Strategy
from cadence.distributed.torchrun import agent_store_address, torchrun_ranks
from cadence.engine.noise_scale import FirstGradient, gradient_norm, local_first_gradient
from cadence.memory.recompute import checkpoint_blocks
from cadence.models.safetensors_file import TensorSpec, write_streamed


@dataclass(frozen=True, kw_only=True)
class Ranks:
    """Where this process stands: its rank among ``world_size`` processes and how they share the model."""

    rank: int = 0
    local_rank: int = 0
    """Rank on this machine: picks the CUDA device."""
    world_size: int = 1
    launched: bool = False
    """True under torchrun (a process group exists, even with one process)."""
    strategy: Strategy = "ddp"
    sync_every_micro_step: bool = False

    @property
    def is_main(self) -> bool:
        """Rank 0 alone prints and writes the run directory."""
        return self.rank == 0


SINGLE = Ranks()
"""One process, no process group."""


def start(*, device_type: str, strategy: Strategy, sync_every_micro_step: bool, timeout_s: float) -> Ranks:
    """Join torchrun's process group: nccl on CUDA, gloo on CPU.

    ``timeout_s`` bounds every collective: a rank that hangs (rather than dies, which torchrun sees at once) fails
    the run after that long instead of blocking the others forever.
    """
    found = torchrun_ranks()
    if found is None:
        raise RuntimeError("not started by torchrun (RANK and WORLD_SIZE are not set)")
    rank, local_rank, world_size = found
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        shared = agent_store_address()
        if shared is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, timeout=timeout, rank=rank, world_size=world_size,
                                    store=attempt_store(shared, rank, world_size, timeout))
    return Ranks(rank=rank, local_rank=local_rank, world_size=world_size, launched=True, strategy=strategy,
                 sync_every_micro_step=sync_every_micro_step)


ATTEMPT_KEYS = "cadence/attempt"
"""Where in the agent's store the ranks of one start agree on a namespace of their own (:func:`attempt_store`)."""
ATTEMPT_POLL_S = 0.02
"""How often rank 0 looks for the other ranks' tokens while they join."""


def attempt_store(address: tuple[str, int], rank: int, world_size: int,
                   timeout: datetime.timedelta) -> dist.Store:
    """The agent's store under a namespace that this start of the ranks alone uses.

    torch's elastic agent keeps one store for all the starts of a launch, and torch.distributed finds its keys
    there with no mark of the start: after a restart a rank may read the address a rank of the failed start left
    (gloo: "Connection refused" at connectFullMesh, or a hang; pytorch#135712). TORCHELASTIC_RESTART_COUNT cannot
    tell the starts apart, since an agent whose workers stayed healthy restarts them without counting. So rank 0
    draws a fresh namespace, and every other rank asks for it with a fresh token of its own: an answer to that
    token cannot be a stale one. Rank 0 answers every token it sees until each rank has confirmed, under the new
    namespace, that it has it."""
    host, port = address
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    if rank != 0:
        token = uuid.uuid4().hex
        store.set(f"{ATTEMPT_KEYS}/ask/{rank}", token)
        store.wait([f"{ATTEMPT_KEYS}/answer/{token}"], timeout)
        namespace = store.get(f"{ATTEMPT_KEYS}/answer/{token}").decode()
        store.set(f"{namespace}/has/{rank}", "1")
        return dist.PrefixStore(namespace, store)
    namespace = f"{ATTEMPT_KEYS}/{uuid.uuid4().hex}"
    confirmed = [f"{namespace}/has/{other}" for other in range(1, world_size)]
    deadline = time.monotonic() + timeout.total_seconds()
    answered: set[bytes] = set()
    while confirmed and not store.check(confirmed):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the other ranks did not join within {timeout.total_seconds():g} s")
        for other in range(1, world_size):
            key = f"{ATTEMPT_KEYS}/ask/{other}"
            asked = store.get(key) if store.check([key]) else None
            if asked is not None and asked not in answered:  # a stale token's answer is never read
                store.set(f"{ATTEMPT_KEYS}/answer/{asked.decode()}", namespace)
                answered.add(asked)
        time.sleep(ATTEMPT_POLL_S)
    return dist.PrefixStore(namespace, store)


def stop(ranks: Ranks) -> None:
    """Leave the process group after a run that succeeded on every rank.

    The barrier first: a rank that tears its connections down while rank 0 still writes the run directory made
    gloo abort at exit ("terminate called without an active exception"). After a failure nothing is torn down:
    the process exits, and waiting for ranks that may be gone could hang."""
    if ranks.launched and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def rank_device(device: torch.device, ranks: Ranks) -> torch.device:
    """Each process on a machine gets its own GPU (cuda:LOCAL_RANK); CPU processes share the CPU."""
    if device.type == "cuda" and ranks.launched:
        return torch.device("cuda", ranks.local_rank)
    return device


# ---------------------------------------------------------------------------------------------------- wrapping
def wrap_model(model: torch.nn.Module, ranks: Ranks, device: torch.device, *,
               precision: str = "fp32") -> torch.nn.Module:
    """DDP or FSDP2 around ``model`` (already on ``device``, recompute already applied); unchanged without torchrun.

    Build the optimizer AFTER this: FSDP2 replaces the parameters with sharded DTensors. Under ``precision="bf16"``
    FSDP2 all-gathers bf16 copies of the parameters (half the traffic and the gathered memory of fp32) and
    reduce-scatters the gradients in fp32; the sharded parameters, the optimizer and gradient accumulation stay fp32.
    """
    if not ranks.launched:
        return model
    if ranks.strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # autocast would cast every gathered fp32 weight to bf16 inside each matmul anyway: casting the shard once
        # before the all-gather gives the forward the same bf16 weights. The reduction stays fp32, so summing the
        # ranks' gradients loses no digits (and FSDP2 accumulates unsynchronised micro-batches in that dtype too).
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if precision == "bf16" else MixedPrecisionPolicy())
        # One FSDP unit per transformer block (all-gathered just before its forward, freed after), and the root
        # for the rest (embeddings, final norm, a tied head): the usual granularity (torchtitan, torchtune).
        for block in checkpoint_blocks(model):
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        # cadence's models keep no running statistics (BatchNorm is refused by verify): broadcasting buffers
        # before every forward would only add a collective per micro-batch.
        forward_sync_buffers=False,
        # Gradients live in DDP's communication buckets: one copy of the gradients instead of two.
        gradient_as_bucket_view=True,
    )


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP (FSDP2 shards in place: the module is its own wrapper)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


class ProcessGroupCollective:
    """The engine's Collective over torch.distributed: DDP's ``no_sync`` or FSDP2's gradient-sync switch, and sums."""

    def __init__(self, ranks: Ranks, device: torch.device) -> None:
        self.ranks = ranks
        self.world_size = ranks.world_size
        # nccl reduces CUDA tensors only; gloo reduces CPU tensors.
        self._reduce_device = device if device.type == "cuda" else torch.device("cpu")
        # The noise scale's view of a synchronising backward (watch_local_gradients): whether a hook is registered,
        # whether it takes norms in the current backward, and their sum of squares so far.
        self._watching = False
        self._armed = False
        self._local_sq: torch.Tensor | None = None

    @contextlib.contextmanager
    def gradient_sync(self, model: torch.nn.Module, enabled: bool) -> Iterator[None]:
        if self.ranks.strategy == "fsdp":
            fsdp_model: Any = model
            # Without sync, FSDP2 keeps each micro-batch's UNSHARDED gradients (memory of a full gradient per rank)
            # and reduce-scatters once per window; --sync-every-micro-step reduce-scatters every micro-batch into
            # sharded gradients instead: 1/world of the gradient memory, accum times the communication.
            fsdp_model.set_requires_gradient_sync(enabled or self.ranks.sync_every_micro_step)
            try:
                yield
            finally:
                fsdp_model.set_requires_gradient_sync(True)
            return
        if enabled or self.ranks.sync_every_micro_step:
            yield
            return
        # DDP decides in forward whether the following backward all-reduces: no_sync must wrap the forward too.
        with cast(DistributedDataParallel, model).no_sync():
            yield

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        reduced = values.to(self._reduce_device)
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
        return reduced.cpu()

    # ------------------------------------------------------------------------------------ the gradient noise scale
    def watch_local_gradients(self, model: torch.nn.Module) -> None:
        """Under DDP, register a communication hook that can take the norm of this rank's own gradient just before
        DDP all-reduces it (the all-reduce itself is DDP's default, unchanged): a window of one micro-batch per rank
        syncs inside its only backward, and the noise scale then compares this rank's gradient with the all-reduced
        one. Call once, before the first backward, when the noise scale is measured (a model takes one hook only)."""
        if self.ranks.strategy != "ddp":
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        # No annotations: DDP compares them with dist.GradBucket as real types, and this module's are strings.
        def hook(state, bucket):
            if self._armed:
                # Before the all-reduce averages the bucket in place: this rank's gradient, one bucket at a time
                # (queued on the stream the all-reduce then waits on; nothing is read back).
                squared = torch.linalg.vector_norm(bucket.buffer()).square()
                self._local_sq = squared if self._local_sq is None else self._local_sq + squared
            return default_hooks.allreduce_hook(state, bucket)

        cast(DistributedDataParallel, model).register_comm_hook(None, hook)
        self._watching = True

    def first_gradient_problem(self, *, synced: bool) -> str | None:
        """Why the first micro-batch's gradient cannot be read for the noise scale (None when it can); ``synced``:
        that micro-batch is also the window's last, so its backward synchronises."""
        every = self.ranks.sync_every_micro_step
        if self.ranks.strategy == "fsdp":
            if synced:
                return ("under FSDP2 the window's only micro-batch is reduce-scattered inside its backward and no "
                        "rank keeps its own gradient: accumulate 2 or more micro-batches, with "
                        "--sync-every-micro-step")
            if not every:
                return ("under FSDP2 an unsynchronised micro-batch's gradient stays inside FSDP2's own parameter "
                        "state, which has no public accessor; with --sync-every-micro-step it is in the sharded "
                        "gradients, where its norm costs one small all-reduce")
            return None
        if (synced or every) and not self._watching:
            return ("DDP all-reduces this micro-batch's gradient inside its backward, and no communication hook "
                    "takes its local norm first (ProcessGroupCollective.watch_local_gradients)")
        return None

    @contextlib.contextmanager
    def first_gradient(self, model: torch.nn.Module, *, synced: bool) -> Iterator[FirstGradient]:
        """The window's first micro-batch's gradient for the noise scale (cadence.engine.noise_scale), read after
        its backward: this rank's own under DDP (unsynchronised in the parameters, or taken by the hook of
        ``watch_local_gradients`` before the all-reduce); under FSDP2 with --sync-every-micro-step the sharded,
        reduced gradient of all ranks' first micro-batches, whose norm costs one scalar all-reduce."""
        problem = self.first_gradient_problem(synced=synced)
        if problem is not None:
            yield FirstGradient(unavailable=problem)
            return
        if self.ranks.strategy == "fsdp":
            found = FirstGradient(reduced=True)
            yield found
            found.norm = gradient_norm(model.parameters())  # DTensor shards: full_tensor() all-reduces the sum
            return
        if not (synced or self.ranks.sync_every_micro_step):
            with local_first_gradient(model) as found:  # no_sync kept this rank's own gradient in the parameters
                yield found
            return
        found = FirstGradient()
        self._local_sq, self._armed = None, True
        try:
            yield found
        finally:
            self._armed = False
        if self._local_sq is None:
            found.unavailable = "DDP's communication hook saw no gradient bucket in this backward"
        else:
            found.norm, self._local_sq = self._local_sq.sqrt(), None


def any_rank(flag: bool, ranks: Ranks) -> bool:
    """True on every rank when ``flag`` is true on at least one: decisions that must be taken together (stop on a
    signal, give up), so that no rank waits in a collective the others will never enter."""
    if not ranks.launched:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        value = value.cuda()
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def max_over_ranks(value: int | None, ranks: Ranks) -> int | None:
    """The largest value over ranks (None counts as absent): e.g. the peak memory of the busiest rank."""
    if not ranks.launched:
        return value
    tensor = torch.tensor([-1 if value is None else value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    result = int(tensor.item())
    return None if result < 0 else result


def broadcast_from_main(obj: Any, ranks: Ranks) -> Any:
    """Rank 0's ``obj`` on every rank (a picklable value, such as the default run directory's name)."""
    if not ranks.launched:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_from_all(obj: Any, ranks: Ranks) -> list[Any]:
    """Every rank's ``obj`` (a small picklable value), in rank order, on every rank."""
    if not ranks.launched:
        return [obj]
    found: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(found, obj)
    return found


# ---------------------------------------------------------------------------------------------------- state
def full_model_state(model: torch.nn.Module, ranks: Ranks) -> dict[str, torch.Tensor]:
    """The whole model's weights with the user's parameter names, on the CPU; every rank must call this (FSDP2
    gathers the shards), and only rank 0 is guaranteed the full dict."""
    if ranks.launched and ranks.strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Every value of a model's state dict is a tensor (the type's other kinds are for optimizer states).
        return cast(dict[str, torch.Tensor],
                    get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
    return dict(unwrap(model).state_dict())


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 tensor (a DTensor's local part), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def like_parameter(local: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's shard, as :func:`local_shard` gave it) as a tensor like ``parameter``: a DTensor sharded
    as it is under FSDP2, on its device and in its dtype. Raises ValueError when the shard's shape is not this rank's
    shard's."""
    from torch.distributed.tensor import DTensor

    if not isinstance(parameter, DTensor):
        if tuple(local.shape) != tuple(parameter.shape):
            raise ValueError(f"shape {tuple(local.shape)}, not its parameter's {tuple(parameter.shape)}")
        return local.to(parameter.device, parameter.dtype)
    mine = parameter.to_local()
    if tuple(local.shape) != tuple(mine.shape):
        raise ValueError(f"shape {tuple(local.shape)}, not this rank's shard's {tuple(mine.shape)}")
    return DTensor.from_local(local.to(mine.device, mine.dtype), parameter.device_mesh, parameter.placements,
                              run_check=False, shape=parameter.shape, stride=parameter.stride())


def write_full_model_state(model: torch.nn.Module, ranks: Ranks, path: Path | None,
                           metadata: dict[str, str] | None = None) -> None:
    """The whole model's weights (:func:`full_model_state`'s names and values) as the safetensors file ``path``,
    written by rank 0 one tensor at a time under FSDP2: each tensor is all-gathered by every rank in turn
    (``DTensor.full_tensor``), written, and dropped, so no rank ever holds more than one whole tensor besides its
    shards. Every rank calls it; ``path`` is rank 0's (the others pass None). Without FSDP2, the state dict as it is."""
    from torch.distributed.tensor import DTensor

    state: dict[str, torch.Tensor]
    if ranks.launched and ranks.strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        # this rank's shards (views), under full_model_state's names; every value of a model's state is a tensor
        state = cast(dict[str, torch.Tensor], get_model_state_dict(model))
    else:
        state = dict(unwrap(model).state_dict())
    specs = [TensorSpec(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in state.items()]

    def whole() -> Iterator[torch.Tensor]:
        for tensor in state.values():
            yield tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    write_streamed(path if ranks.is_main else None, specs, whole(), metadata)
