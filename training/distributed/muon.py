"""Muon over data-parallel ranks: each weight matrix orthogonalised whole, once, on one owner rank.

torch.optim.Muon orthogonalises the tensor it is handed. Under ddp every rank holds every matrix
whole, so each of N ranks would run Newton-Schulz on every matrix: the same work N times. Under
fsdp a rank holds a block of rows of each matrix, and orthogonalising a block of rows is not
orthogonalising the matrix: that update is not Muon's.

DistributedMuon keeps torch.optim.Muon's state and math, and changes only where Newton-Schulz runs.
For each matrix, in one order that every rank shares:

  1. momentum  every rank, on what it holds (the whole matrix under ddp, its rows under fsdp):
               elementwise, so a shard's momentum is bit for bit the rows of the whole one's
  2. gather    the matrix's owner collects the whole Nesterov update: under fsdp a gather of
               the ranks' rows to the owner; under ddp the owner already has it
  3. NS        the owner alone orthogonalises it, with torch's own Newton-Schulz function
  4. return    the result goes back: under fsdp each rank is sent its rows (a scatter), under
               ddp every rank the whole matrix (a broadcast)
  5. apply     every rank, on what it holds: decoupled weight decay, then the update with torch's
               shape-adjusted lr, in torch.optim.Muon's order

So the update equals one-process Muon's: step 3 sees the same whole matrix. Every rank reaches
every gather, scatter and broadcast, matrix by matrix in the same order, and none of them waits
on a tensor's value on the host (no .item(): on a GPU they are queued like any kernel).

Owners are chosen from the shapes alone (greedy by Newton-Schulz cost: largest first, onto the
least loaded rank), the same on every rank, so each does about 1/N of the work. Ownership is not
state: the only state is each matrix's momentum_buffer, laid out like its parameter (whole, or
sharded like it), under torch.optim.Muon's key. A checkpoint does not depend on who owned what,
and a Muon run resumes on another world size or strategy like an AdamW run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from training.distributed.strategies import is_sharded, local_part

# torch.optim.Muon's own Newton-Schulz and lr adjustment (PyTorch 2.9+): the math is torch's,
# this module only decides where it runs. Both are private names; muon_math_missing() says so
# in one line if a PyTorch release drops them.
try:
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
except ImportError:  # older than 2.9, or renamed
    _adjust_lr = _zeropower_via_newtonschulz = None


def muon_math_missing() -> bool:
    return _zeropower_via_newtonschulz is None or _adjust_lr is None


def newton_schulz_cost(shape: torch.Size) -> int:
    """Multiply-adds of one Newton-Schulz iteration on an (a, b) matrix: the Gram matrix of the
    shorter side, s*s*l, and its products, about 2*s*s*l more (s = min, l = max)."""
    short, long = sorted(shape[:2])
    return short * short * long


def assign_owners(shapes: list[torch.Size], world_size: int) -> list[int]:
    """The rank that orthogonalises each matrix: the costliest first, each onto the least loaded
    rank (the lowest on a tie). A pure function of the shapes, so every rank computes the same."""
    load = [0] * world_size
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-newton_schulz_cost(shapes[i]), i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += newton_schulz_cost(shapes[i])
    return owners


# torch.optim.Muon is PyTorch 2.9's; with an older one the config refuses optimizer muon before this is built
class DistributedMuon(getattr(torch.optim, "Muon", torch.optim.Optimizer)):
    """torch.optim.Muon whose Newton-Schulz runs once per matrix, on its owner rank, on the whole matrix.

    The parameters are either all plain tensors, replicated on every rank of `group` (ddp; None:
    the default group, or one process when torch.distributed is not initialised), or all DTensors
    sharded by rows over a one-dimensional mesh (FSDP2's Shard(0)). Every rank calls step()."""

    def __init__(self, params, group: dist.ProcessGroup | None = None, **muon_options):
        super().__init__(params, **muon_options)
        matrices = [p for g in self.param_groups for p in g["params"]]
        sharded = [is_sharded(p) for p in matrices]
        if any(sharded) and not all(sharded):
            raise ValueError("DistributedMuon: the matrices are either all sharded (fsdp) or all whole (ddp)")
        self.sharded = bool(sharded) and all(sharded)
        if self.sharded:
            meshes = {id(p.device_mesh) for p in matrices}
            if len(meshes) != 1 or matrices[0].device_mesh.ndim != 1:
                raise ValueError("DistributedMuon: sharded matrices must share one one-dimensional mesh")
            for p in matrices:
                if not (len(p.placements) == 1 and p.placements[0].is_shard(0)):
                    raise ValueError(f"DistributedMuon: a matrix is placed {p.placements}; only rows (Shard(0)) are")
            group = matrices[0].device_mesh.get_group()
        self.group = group if group is not None or not dist.is_initialized() else dist.group.WORLD
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.world_size = dist.get_world_size(self.group) if self.group is not None else 1
        self.owners = dict(zip(map(id, matrices), assign_owners([p.shape for p in matrices], self.world_size)))
        self.result_dtypes: dict[torch.dtype, torch.dtype] = {}  # Newton-Schulz's output dtype per input dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            updates = [self._momentum(p, group) for p in params]  # 1. what this rank holds
            wholes = [self._gather(p, u) for p, u in zip(params, updates)]  # 2. None where not the owner
            orthogonal = [None if whole is None else self._orthogonalize(whole, group) for whole in wholes]  # 3.
            for p, o in zip(params, orthogonal):  # 4. and 5.
                mine = self._share(p, o)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                local_part(p).add_(mine, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], p.shape))
        return loss

    # --- the five steps' parts -------------------------------------------------------------------
    def _momentum(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """torch.optim.Muon's momentum, on this rank's part: the buffer is kept, the Nesterov update returned."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - group["momentum"])
        update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
        return local_part(update)

    def _owner(self, p: torch.Tensor) -> int:
        return self.owners[id(p)]

    def _gather(self, p: torch.Tensor, update: torch.Tensor) -> torch.Tensor | None:
        """The whole update matrix on p's owner (None on the other ranks).

        Under fsdp, rank r holds rows [r*c, r*c + its rows) with c = ceil(rows / N) (torch.chunk's
        split: whole chunks first). Each rank pads its rows to c, the owner gathers the N blocks
        and keeps the first `rows` rows, which are the matrix in order."""
        if not self.sharded:
            return update if self.rank == self._owner(p) else None
        rows = self._rows_per_rank(p)
        padded = pad_rows(update, rows)
        owner = self._owner(p)
        blocks = [torch.empty_like(padded) for _ in range(self.world_size)] if self.rank == owner else None
        dist.gather(padded, blocks, dst=dist.get_global_rank(self.group, owner), group=self.group)
        return torch.cat(blocks)[: p.shape[0]] if blocks is not None else None

    def _orthogonalize(self, whole: torch.Tensor, group: dict) -> torch.Tensor:
        # contiguous: torch's function returns a tall matrix's result as a transposed view
        return _zeropower_via_newtonschulz(whole, ns_coefficients=group["ns_coefficients"],
                                           ns_steps=group["ns_steps"], eps=group["eps"]).contiguous()

    def _share(self, p: torch.Tensor, orthogonal: torch.Tensor | None) -> torch.Tensor:
        """This rank's part of p's orthogonalised update, sent from the owner (which passes its own)."""
        if self.world_size == 1:
            return orthogonal
        owner = dist.get_global_rank(self.group, self._owner(p))
        if not self.sharded:  # ddp: every rank applies the whole update
            whole = orthogonal if orthogonal is not None else torch.empty(
                p.shape, dtype=self._result_dtype(p), device=p.device)
            dist.broadcast(whole, src=owner, group=self.group)
            return whole
        rows = self._rows_per_rank(p)
        mine = torch.empty((rows, *p.shape[1:]), dtype=self._result_dtype(p), device=local_part(p).device)
        blocks = None
        if orthogonal is not None:
            blocks = list(pad_rows(orthogonal, rows * self.world_size).split(rows))
        dist.scatter(mine, blocks, src=owner, group=self.group)
        return mine[: local_part(p).shape[0]]

    def _rows_per_rank(self, p: torch.Tensor) -> int:
        rows = -(-p.shape[0] // self.world_size)  # ceil
        held = local_part(p).shape[0]
        expected = max(0, min(rows, p.shape[0] - self.rank * rows))
        if held != expected:  # a split other than torch.chunk's would put rows in the wrong place
            raise RuntimeError(f"DistributedMuon: rank {self.rank} holds {held} rows of a {tuple(p.shape)} matrix, "
                               f"expected {expected} (torch.chunk's split over {self.world_size} ranks)")
        return rows

    def _result_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype Newton-Schulz returns for p's dtype (bfloat16 in torch's): what the non-owners
        receive into. Found once per dtype, on a 2x2 matrix, so it follows torch's function."""
        if p.dtype not in self.result_dtypes:
            probe = torch.eye(2, dtype=p.dtype, device=local_part(p).device)
            self.result_dtypes[p.dtype] = self._orthogonalize(probe, self.param_groups[0]).dtype
        return self.result_dtypes[p.dtype]


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t with zero rows appended up to `rows` rows (t itself when it has them), contiguous for a collective."""
    if t.shape[0] == rows:
        return t.contiguous()
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])
