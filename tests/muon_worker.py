"""One rank of the distributed Muon check (tests/test_muon.py): DistributedMuon against torch.optim.Muon.

    main([out_dir, layout, variant])   layout: whole (ddp's replicated matrices) or rows (fsdp's
                                       Shard(0) DTensors); variant: right, or local (the mutation:
                                       each rank orthogonalises its own rows, not the whole matrix)

Every rank builds the same float64 matrices and, each step, the same gradients; one
torch.optim.Muon on whole copies is the reference. After each of 3 steps this rank's matrices,
made whole, are compared with the reference's bit for bit. Writes OUT/rank<r>.json: whether all
matched, the largest difference, and how many Newton-Schulz runs this rank did.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# rows that do not divide by 2 or 3 (7, 5, 9), a tall matrix (Newton-Schulz transposes it), a wide one,
# and one with fewer rows (2) than 3 ranks have shards: the third rank holds none of it
SHAPES = [(7, 5), (5, 7), (12, 4), (9, 9), (2, 6), (16, 8)]
OPTIONS = dict(lr=0.02, momentum=0.95, weight_decay=0.01, nesterov=True)


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    from training.distributed.muon import DistributedMuon

    out, layout, variant = Path(argv[0]), argv[1], argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    initial = [torch.randn(shape, dtype=torch.float64) for shape in SHAPES]
    reference = [torch.nn.Parameter(w.clone()) for w in initial]
    reference_muon = torch.optim.Muon(reference, **OPTIONS)

    mesh = init_device_mesh("cpu", (world,)) if layout == "rows" else None

    def place(t: torch.Tensor) -> torch.Tensor:
        return distribute_tensor(t, mesh, [Shard(0)]) if mesh is not None else t.clone()

    mine = [torch.nn.Parameter(place(w)) for w in initial]
    cls = DistributedMuon if variant == "right" else LocalRows.make(DistributedMuon)
    muon = cls(mine, **OPTIONS)
    runs = 0
    orthogonalize = muon._orthogonalize

    def counted(*args, **kwargs):
        nonlocal runs
        runs += 1
        return orthogonalize(*args, **kwargs)

    muon._orthogonalize = counted
    worst, matched, host_syncs = 0.0, True, 0
    for _ in range(3):
        grads = [torch.randn(shape, dtype=torch.float64) for shape in SHAPES]
        for p, g in zip(reference, grads):
            p.grad = g.clone()
        for p, g in zip(mine, grads):
            p.grad = place(g)
        reference_muon.step()
        with counting_host_syncs() as syncs:
            muon.step()
        host_syncs += syncs[0]
        for p, ref in zip(mine, reference):
            whole = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            matched &= torch.equal(whole, ref.detach())
            worst = max(worst, (whole - ref.detach()).abs().max().item())
        # the state stays laid out like the parameter: whole, or this rank's rows
        for p in mine:
            buf = muon.state[p]["momentum_buffer"]
            assert type(buf) is type(p.data) and buf.shape == p.shape, (type(buf), buf.shape)
    (out / f"rank{rank}.json").write_text(json.dumps({"matched": matched, "worst": worst, "runs": runs, "host_syncs": host_syncs,
                                                      "owners": [muon.owners[id(p)] for p in mine]}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


@contextlib.contextmanager
def counting_host_syncs():
    """Counts the calls from training/distributed/muon.py that make the host wait for a tensor's value."""
    count = [0]
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "cpu", "numpy", "__bool__",
                                                                 "__float__", "__int__")}

    def wrap(original):
        def method(self, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename.endswith(os.path.join("distributed", "muon.py")):
                count[0] += 1
            return original(self, *args, **kwargs)
        return method

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(original))
    try:
        yield count
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class LocalRows:
    """The mutation the check must catch: Newton-Schulz on what this rank holds (its rows under fsdp)."""

    @staticmethod
    def make(base):
        class Mutant(base):
            def _gather(self, p, update):
                return update

            def _share(self, p, orthogonal):
                return orthogonal

        return Mutant


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
