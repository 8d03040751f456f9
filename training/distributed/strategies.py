"""How the model is spread over the ranks: the `strategy` key, one class per strategy, one registry.

ddp         every rank holds the whole model, its gradients and the AdamW state (16 bytes per
            parameter); DistributedDataParallel all-reduces the gradients once per step.
fsdp        PyTorch's FSDP2 (`fully_shard`) on every transformer block and on the whole model:
            parameters, gradients and AdamW state are sharded over the ranks, like ZeRO-3;
            a block's parameters are all-gathered just before its forward and its backward,
            and freed after each.
fsdp_zero2  the same, but a block keeps its gathered parameters from its forward to its
            backward (reshard_after_forward=False): one all-gather per step instead of two,
            more memory, like ZeRO-2.

Everything else is the same for all of them: the data (the loader is world-size independent),
the step's math (bf16 autocast over float32 parameters, as under DDP), and the checkpoints
(full state dicts gathered to rank 0 in the file format, parameter names in the sharded one),
so a run can resume under another strategy or world size. Gradient accumulation never syncs
gradients before the last micro-step (DDP's no_sync, FSDP's set_requires_gradient_sync);
gradient clipping uses the global norm.

What the rest of the trainer reads of a strategy is its data-parallel view (dp_rank, dp_size, mesh)
and its attributes, never its name. So another strategy whose every rank is a data-parallel replica
is one Strategy subclass, its entry in STRATEGIES, and its description in runtime_settings.py's
STRATEGY_INFO (torch-free: the configuration checks the name before torch is imported); one whose
replicas span several ranks (tensor or context parallel) also needs the model split, and the
evaluations' all-reduces (val loss sums, HellaSwag counts) made to count each replica once.
"""

from __future__ import annotations

import contextlib
import functools
from typing import ClassVar

import torch
from torch.nn.parallel import DistributedDataParallel

from common.errors import ConfigError
from model import GPT
from runtime.process_group import DistEnv
from runtime.runtime import Runtime
from runtime.settings import STRATEGY_INFO

SyncContext = contextlib.AbstractContextManager  # what gradient_sync returns


class Strategy:
    """The data-parallel strategy of a run: what differs between them. Every method is called on every rank."""

    name: ClassVar[str]  # the `strategy` key's value: its key in STRATEGIES and in STRATEGY_INFO
    forwards_are_collective: ClassVar[bool] = False  # FSDP: every forward all-gathers, so every rank runs each

    def __init__(self, env: DistEnv, runtime: Runtime):
        self.env, self.runtime = env, runtime

    @property
    def default_checkpoint_format(self) -> str:
        """What checkpoint_format auto means under this strategy: file or sharded (STRATEGY_INFO)."""
        return STRATEGY_INFO[self.name].default_checkpoint_format

    # --- the data-parallel view ----------------------------------------------------------------
    # The ranks as the data sees them: dp_size replicas, each reading its own share of every
    # batch (the loaders, grad_accum_steps, the val and HellaSwag shards). Every rank is one
    # replica under ddp and fsdp, so these are env.rank and env.world_size; a strategy whose
    # replicas span several ranks (tensor parallel) overrides them. What is per process
    # (file names, rank 0's logs, the dropout seed, per-rank timings) keeps env.rank.
    @property
    def dp_rank(self) -> int:
        """Which replica this rank is, in [0, dp_size): the share of the data it reads."""
        return self.env.rank

    @property
    def dp_size(self) -> int:
        """How many replicas split each batch: the data-parallel world size."""
        return self.env.world_size

    @property
    def mesh(self):
        """The DeviceMesh the parameters are spread over (torch.distributed.device_mesh), or None
        where they are not (ddp: a full copy per rank)."""
        return None

    # --- building ------------------------------------------------------------------------------
    def shard(self, model: GPT) -> None:
        """Spread the model's parameters over the ranks, in place, before the optimizer is made."""

    def training_model(self, model: GPT) -> torch.nn.Module:
        """The module the training forward goes through: its blocks recomputed in backward as
        runtime.recompute_every says (inside each block's forward, so within FSDP's per-block
        gathers and DDP's hooks, and traced by torch.compile), their residual add and layer norm fused
        where runtime.add_norm is set (fused_residual_norm), compiled (runtime.compile, in its
        compile_mode), and wrapped."""
        model.recompute_blocks(self.runtime.recompute_every)
        model.fuse_residual_norms(self.runtime.add_norm)
        return self.runtime.compiled(model) if self.runtime.compile else model

    def probe_model(self, model: GPT) -> torch.nn.Module:
        """The training forward for micro_batch_size auto's probes (launch/micro_batch.py): recomputed
        and compiled as training_model's, but never syncing gradients, and without DDP's wrapper (its
        construction and its hooks are collectives a probe that runs out of memory would leave unmatched)."""
        return Strategy.training_model(self, model)

    def check_accumulation(self, grad_accum_steps: int) -> None:
        """A ConfigError where this strategy cannot accumulate grad_accum_steps micro-batches per step."""

    # --- the step ------------------------------------------------------------------------------
    def gradient_sync(self, model: GPT, train_model: torch.nn.Module, enabled: bool) -> SyncContext:
        """Context for one micro-step's forward and backward: sync gradients only when enabled."""
        raise NotImplementedError

    def clip_grad_norm(self, model: GPT, max_norm: float) -> torch.Tensor:
        """Clip to the global gradient norm over all ranks; that norm, as a plain 0-d tensor."""
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    # --- evaluation ----------------------------------------------------------------------------
    def evaluation(self, model: GPT) -> contextlib.AbstractContextManager:
        """Context in which model.hidden_states / lm_head / generate may run outside forward()."""
        return contextlib.nullcontext()

    def idle_forward(self, model: GPT) -> None:
        """Join the other ranks' evaluation forward with one whose result is discarded.

        Where every forward is a collective (FSDP), every rank must run as many forwards as the
        others, also when its share of an evaluation's batches is smaller (3 val batches over 2
        ranks): it pads with these. A no-op where forwards are local.
        """


class DDP(Strategy):
    """A full replica per rank; gradients all-reduced once per step. One process: no wrapper at all."""

    name = "ddp"

    def training_model(self, model: GPT) -> torch.nn.Module:
        train_model = super().training_model(model)
        if not self.env.distributed:
            return train_model
        # the ddp_* keys' bucket size, bucket views and static graph, where set (runtime.ddp.kwargs: none by default)
        return DistributedDataParallel(train_model, device_ids=[self.env.local_rank]
                                       if self.runtime.device_type == "cuda" else None, **self.runtime.ddp.kwargs())

    def check_accumulation(self, grad_accum_steps: int) -> None:
        # DDP's static graph fails inside its reducer (an internal assertion) at the first backward under no_sync
        if self.env.distributed and self.runtime.ddp.static_graph and grad_accum_steps > 1:
            raise ConfigError(f"ddp_static_graph: DDP's static graph does not take gradient accumulation, and each "
                              f"rank accumulates {grad_accum_steps} micro-batches a step here: set ddp_static_graph "
                              f"false, or micro_batch_size so that grad_accum_steps is 1")

    def gradient_sync(self, model: GPT, train_model: torch.nn.Module, enabled: bool) -> SyncContext:
        if self.env.distributed and not enabled:
            return train_model.no_sync()  # covers the forward and the backward
        return contextlib.nullcontext()


class FSDP(Strategy):
    """FSDP2: parameters, gradients and optimizer state sharded over the ranks (ZeRO-3)."""

    name = "fsdp"
    forwards_are_collective = True
    reshard_after_forward: ClassVar[bool] = True  # free a block's gathered parameters after its forward

    def __init__(self, env: DistEnv, runtime: Runtime):
        super().__init__(env, runtime)
        if not env.distributed:
            raise ConfigError(f"strategy: {self.name} shards over the ranks of a torchrun launch; one process uses ddp")
        if runtime.loss_scaling:  # the scaler's overflow check would see one shard per rank
            raise ConfigError(f"strategy: {self.name} does not support dtype float16; use ddp, or a GPU with bfloat16")

    @functools.cached_property
    def mesh(self):
        """One dimension over all the ranks, made at the first use (shard)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.runtime.device_type, (self.env.world_size,))

    def shard(self, model: GPT) -> None:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block, mesh=self.mesh, reshard_after_forward=self.reshard_after_forward)
        # the root holds the embeddings (tied with lm_head), the final LayerNorm; its parameters
        # are used last in the forward, so resharding them after it would only re-gather them
        fully_shard(model, mesh=self.mesh, reshard_after_forward=False)

    def training_model(self, model: GPT) -> torch.nn.Module:
        # FSDP sets itself up at the root's first forward; evaluations call the blocks directly,
        # so that first forward (one token, no gradients) happens now
        with torch.no_grad():
            model(torch.zeros((1, 1), dtype=torch.long, device=self.runtime.device))
        reshard_all(model)  # fsdp_zero2's blocks keep what a forward gathered: back to the shards
        return super().training_model(model)

    def probe_model(self, model: GPT) -> torch.nn.Module:
        # the forwards all-gather, so every rank probes the same sizes (micro_batch.py agrees on each probe)
        train_model = self.training_model(model)
        model.set_requires_gradient_sync(False)  # no reduce-scatter; the step sets it again every micro-step
        return train_model

    def gradient_sync(self, model: GPT, train_model: torch.nn.Module, enabled: bool) -> SyncContext:
        model.set_requires_gradient_sync(enabled)  # no reduce-scatter before the last micro-step
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: GPT, max_norm: float) -> torch.Tensor:
        return super().clip_grad_norm(model, max_norm).full_tensor()  # a DTensor over the shards

    @contextlib.contextmanager
    def evaluation(self, model: GPT):
        """Only forward() calls gather a module's parameters, so the root's own (embeddings,
        lm_head, final LayerNorm) are gathered for the evaluation's duration; the blocks gather
        theirs when called. A collective: every rank evaluates.

        On exit every module is back to its shards, the blocks too: fsdp_zero2's keep what a forward
        gathered until a backward, and an evaluation has none. So after an evaluation the model's
        parameters are its shards, as after a step: what the EMA's swap (training/optim/ema.py)
        exchanges, and the next forward gathers again from them (not from buffers of another swap)."""
        model.unshard()
        try:
            yield
        finally:
            reshard_all(model)

    def idle_forward(self, model: GPT) -> None:
        with torch.no_grad():
            model.hidden_states(torch.zeros((1, 1), dtype=torch.long, device=self.runtime.device))


def reshard_all(model: GPT) -> None:
    """Every FSDP module of model back to its shards (FSDPModule.reshard is not recursive): its registered
    parameters are then the sharded DTensors, and the gathered copies are freed. Local: no collective."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class FSDPZero2(FSDP):
    """FSDP2 keeping each block's parameters gathered from its forward to its backward (ZeRO-2)."""

    name = "fsdp_zero2"
    reshard_after_forward = False


STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (DDP, FSDP, FSDPZero2)}


def make_strategy(name: str, env: DistEnv, runtime: Runtime) -> Strategy:
    """The strategy the `strategy` key names (the config checked the name against STRATEGIES)."""
    return STRATEGIES[name](env, runtime)


def own_cpu_state(optimizer: torch.optim.Optimizer) -> None:
    """Give the optimizer's CPU state tensors memory of their own.

    A checkpoint file is loaded memory-mapped, and Optimizer.load_state_dict keeps a tensor that
    is already on its parameter's device as it is: on the CPU (moments, and the step counts on
    any device) a view into the file, which would keep the file mapped, and its disk space taken
    after retention deletes it, for the rest of the run.
    """
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.device.type == "cpu":
                state[key] = value.clone()


def parameter_names(model: GPT, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each optimizer parameter, in the order optimizer.state_dict() numbers them
    (through its groups, in order): what names its indices, for checkpoints keyed by name."""
    names = {id(p): name for name, p in model.named_parameters()}  # a tied weight under its first name
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def by_index(state: dict, names: list[str]) -> dict:
    """An optimizer state dict keyed by parameter name (torch.distributed.checkpoint's) -> by index."""
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in state["param_groups"]]}


def by_name(state: dict, names: list[str]) -> dict:
    """An optimizer state dict keyed by parameter index (optimizer.state_dict()'s) -> by name."""
    return {"state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                             for group in state["param_groups"]]}


def is_sharded(t: torch.Tensor) -> bool:
    """Whether t is a DTensor (a parameter, gradient or state laid out over a mesh, as under FSDP)."""
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of t: a DTensor's shard (the same memory: in-place updates reach the DTensor), or t."""
    return t.to_local() if is_sharded(t) else t


def local_nbytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part of t."""
    local = local_part(t)
    return local.numel() * local.element_size()


def local_state_bytes(model: GPT, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds of parameters, gradients and optimizer state (its shards under FSDP)."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return sum(map(local_nbytes, tensors))


def full_tensors(tensors: dict[str, torch.Tensor], master_process: bool) -> dict[str, torch.Tensor]:
    """Tensors laid out like the parameters (DTensor shards under FSDP), whole on rank 0's CPU; the
    other ranks get {}. Collective under FSDP: every rank gathers every tensor, in the same order."""
    full = {}
    for name, tensor in tensors.items():
        whole = tensor.full_tensor() if is_sharded(tensor) else tensor
        if master_process:
            full[name] = whole.detach().to("cpu", copy=True)
    return full


@torch.no_grad()
def load_full_tensors(tensors: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> None:
    """Copy whole tensors (every rank has them: a file checkpoint's), or tensors laid out like these (DCP's), into
    tensors laid out like the parameters, each rank its own part, cut locally (no collective)."""
    for name, tensor in tensors.items():
        source = full[name].to(tensor.device, tensor.dtype)
        if is_sharded(tensor) and not is_sharded(source):
            from torch.distributed.tensor import distribute_tensor

            source = distribute_tensor(source, tensor.device_mesh, tensor.placements, src_data_rank=None)
        local_part(tensor).copy_(local_part(source))
