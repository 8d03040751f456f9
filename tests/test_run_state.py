"""The run's state: every part of it saved and loaded back exactly in either format, nothing that holds state left
out of Run.parts, and checkpoints of older code (tests/fixtures/old_layout, of 0b24ab4, and
tests/fixtures/layout_33abc7a) resumed exactly through launch/resume.py's current_layout."""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from conftest import assert_same, build_tiny_run, lockstep_steps, make_shards
from launch.components import make_checkpointer
from training.checkpoint.folder import list_checkpoints, load_checkpoint, read_full_state
from training.distributed.strategies import by_index, by_name, parameter_names
from training.optim.spikes import SpikeWindow

FIXTURES = Path(__file__).parent / "fixtures"
# the runs the checkpoints of older code are of (their READMEs), with every part that has state: float16's loss
# scale, an EMA of the weights, a spike window, a mixture of two sources
SETTINGS = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, seq_len=16, vocab_size=64, total_batch_size=256,
                max_steps=6, eval_interval=3, val_tokens=64, dtype="float16", ema_decay=0.9, spike_skip="true",
                spike_window=2)


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> str:
    """data_dir of the two sources the checkpoints of older code were trained on (the same shards, elsewhere)."""
    root = tmp_path_factory.mktemp("sources")
    edu = make_shards(root / "edu", seed=1, vocab=64)
    code = make_shards(root / "code", seed=2, train_sizes=(2100,), prefix="code", vocab=64)
    return f"{edu}:0.75,{code}:0.25"


def losses(results) -> list[float]:
    return [r.loss for r in results]


def snapshot(run) -> dict:
    """All of a run's state, read from its objects themselves (not through Run.parts, which is what is checked)."""
    return {
        "model": run.model.state_dict(),
        "optimizer": by_name(run.optimizer.state_dict(), parameter_names(run.model, run.optimizer))["state"],
        "scaler": run.scaler.state_dict(),
        "ema": [run.ema.average, run.ema.start_step, run.ema.updates],
        "spikes": [run.spikes.values, run.spikes.filled, run.spikes.position],
        "data": run.train_loader.state_dict(run.step, run.step + run.data_offset),
        "own": {key: getattr(run, key) for key in ("step", "tokens_seen", "run_id", "metrics", "finished_at",
                                                    "wandb_run_id", "skips_in_a_row", "rollbacks", "data_offset")},
    }


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_every_part_of_the_run_saves_and_loads_back_exactly(mixture, tmp_path, fmt):
    """A run with every part that has state, and its own values all set, saved in either format and resumed by a
    fresh run: the same run, every part bitwise, the lineage going on; and the next steps are the same."""
    settings = dict(SETTINGS, checkpoint_format=fmt, checkpoint_async="false")
    cfg, ctx, run = build_tiny_run(mixture, tmp_path / "run", **settings)
    lockstep_steps(cfg, ctx, run, 3)
    run.rollbacks, run.skips_in_a_row, run.data_offset = 1, 1, 2  # as a rollback past two batches leaves them
    run.metrics, run.finished_at, run.wandb_run_id = {"val_loss": 4.5}, 2, "w8nd8"
    checkpointer = make_checkpointer(cfg, ctx, run, record={})
    checkpointer.save(run)
    checkpointer.wait()
    ((_, path),) = list_checkpoints(checkpointer.folder)

    again, ctx_again, resumed = build_tiny_run(mixture, tmp_path / "resumed", **settings, resume=path)
    assert resumed.ancestry == [*run.ancestry, load_checkpoint(path)["checkpoint_id"]]
    assert resumed.ema.ready and resumed.spikes.filled == 2 and resumed.scaler.is_enabled()  # every part is in it
    assert_same(snapshot(resumed), snapshot(run))
    assert losses(lockstep_steps(again, ctx_again, resumed, 2)) == losses(lockstep_steps(cfg, ctx, run, 2))
    assert_same(snapshot(resumed), snapshot(run))


def unregistered(run) -> list[str]:
    """The attributes of the run that hold state (state_dict and load_state_dict) that are no part of Run.parts,
    nor what a part holds."""
    held = [value for part in run.parts().values() for value in (part, *vars(part).values())]
    return [name for name, value in vars(run).items() if hasattr(value, "state_dict") and
            hasattr(value, "load_state_dict") and not any(value is h for h in held)]


def plain_fields(run) -> dict:
    """The run's fields that hold plain values (what a checkpoint could keep as they are), copied."""
    def plain(value) -> bool:
        try:
            json.dumps(value)
        except TypeError:
            return False
        return True

    return {f.name: copy.deepcopy(getattr(run, f.name)) for f in fields(run) if plain(getattr(run, f.name))}


def test_nothing_of_the_run_that_holds_state_is_left_out_of_its_state(mixture, tmp_path):
    """Every attribute of the Run that has state is a part (Run.parts) or held by one, and every plain field that
    training changes is of the run's own state (STATE: saved and loaded as it is); an attribute or a field left
    out is found."""
    cfg, ctx, run = build_tiny_run(mixture, tmp_path / "run", **SETTINGS)
    own = {f.name for f in fields(run) if f.metadata.get("state")}
    assert own <= run.state_dict().keys() and run.parts().keys() <= run.state_dict().keys() | {"model", "optimizer",
                                                                                               "ema"}
    assert unregistered(run) == []
    before = plain_fields(run)
    lockstep_steps(cfg, ctx, run, 3)
    changed = {name for name, value in plain_fields(run).items() if value != before[name]}
    assert {"step", "tokens_seen"} <= changed <= own

    run.resumed_step += 1  # as a counter nobody declared
    run.window = SpikeWindow(2, 6.0, torch.device("cpu"), torch.float32)  # as a part nobody registered
    assert {name for name, value in plain_fields(run).items() if value != before[name]} - own == {"resumed_step"}
    assert unregistered(run) == ["window"]


def close(computed: torch.Tensor, stored, atol: float, rtol: float = 0.0) -> bool:
    """computed here against a value of the fixture, trained on another CPU: equal up to that CPU's last bits."""
    return torch.allclose(computed.double(), torch.as_tensor(stored).double(), rtol=rtol, atol=atol)


def spike_window(old: dict) -> dict:
    """A checkpoint's spike window, where its layout keeps it: in long_run (format_version 3 and before), or an
    entry of its own (4 on)."""
    return old["long_run"]["spike_window"] if "long_run" in old else old["spike_window"]


def of_0b24ab4(old: dict) -> None:
    """format_version 3: the spike window and the counters together in long_run; no mixture entry (each source's
    position is its config's), no finished_at."""
    assert old["format_version"] == 3 and old["long_run"]["spike_window"]["filled"] == 2 and old["ema_state"]
    assert not {"mixture", "finished_at", "spike_window", "rollbacks"} & old.keys()


def of_33abc7a(old: dict) -> None:
    """format_version 4: an entry per part (the spike window, skips in a row, rollbacks, data offset; no long_run),
    each source's position in the mixture entry, finished_at saved (None: the run went on)."""
    assert old["format_version"] == 4 and old["spike_window"]["filled"] == 2 and old["ema_state"]["updates"] == 3
    assert (old["skips_in_a_row"], old["rollbacks"], old["data_offset"], old["finished_at"]) == (0, 0, 0, None)
    assert old["mixture"]["step"] == 3 and set(old["mixture"]["sources"]) == {"edu", "code"}
    assert "long_run" not in old


# each fixture folder of checkpoints of older code, and what is true of its layout
LAYOUTS = {"old_layout": of_0b24ab4, "layout_33abc7a": of_33abc7a}


def take_floats(run, old: dict) -> None:
    """The fixture's float tensors (weights, optimizer moments, EMA, spike window) put into a run trained here,
    through the objects' own loaders, not through current_layout's conversion: what the run computed here
    holds alike on every CPU (steps, positions, counters) stays its own."""
    run.model.load_state_dict(old["model"])
    names = parameter_names(run.model, run.optimizer)
    groups = by_name(run.optimizer.state_dict(), names)["param_groups"]
    run.optimizer.load_state_dict(by_index({"state": old["optimizer"]["state"], "param_groups": groups}, names))
    for name, tensor in old["ema"].items():
        run.ema.average[name].copy_(tensor)
    run.spikes.values.copy_(torch.tensor(spike_window(old)["values"]))


@pytest.mark.parametrize("name", ["step_00000003.pt", "step_00000003"], ids=["file", "sharded"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_checkpoint_of_older_code_resumes_exactly(mixture, tmp_path, layout, name):
    """Checkpoint 3 of a run of older code (each fixture folder's README.md): of 0b24ab4, format_version 3, its
    spike window and counters in long_run, no mixture entry (each source's position is its config's), no
    finished_at; of 33abc7a, format_version 4, an entry per part, the mixture's positions and finished_at saved
    (LAYOUTS checks what each holds). Resumed through current_layout, the run is the one today's code has after the
    same 3 steps, and it trains on the same.

    A fixture was trained on another CPU, whose kernels can differ from this one's in the last bits: what it
    computed (weights, moments, losses) is compared with what this run computes within float noise (a step on
    other data differs 100x more), and bit for bit only with itself. Bit for bit against a run trained here:
    the same 3 steps with the fixture's floats put in by hand (take_floats), every part alike, and the next 3
    steps alike."""
    fixture = FIXTURES / layout / name
    old = load_checkpoint(fixture)
    LAYOUTS[layout](old)
    path = tmp_path / name
    (shutil.copytree if fixture.is_dir() else shutil.copy2)(fixture, path)
    old = read_full_state(fixture)  # its tensors too, the optimizer's keyed by parameter name

    cfg, ctx, straight = build_tiny_run(mixture, tmp_path / "straight", **SETTINGS)
    lockstep_steps(cfg, ctx, straight, 3)
    # the same run, up to the last bits of the CPU it was trained on: same losses, same weights (measured: a
    # loss 1e-6 apart, weights 2e-4; one batch further on in the data, 5e-3 and 1e-2)
    assert close(straight.spikes.values, spike_window(old)["values"], atol=0, rtol=1e-4)
    assert all(close(straight.model.state_dict()[key], value, atol=2e-3) for key, value in old["model"].items())

    again, ctx_again, resumed = build_tiny_run(mixture, tmp_path / "resumed", **SETTINGS, resume=path)
    assert (resumed.run_id, resumed.metrics, resumed.finished_at) == (old["run_id"], old["metrics"], None)
    assert resumed.ancestry == [*old["ancestry"], old["checkpoint_id"]]
    assert_same(resumed.model.state_dict(), old["model"])  # what was stored is what is loaded, bit for bit
    take_floats(straight, old)
    straight.run_id, straight.metrics = resumed.run_id, resumed.metrics  # the old run's id and evaluations
    assert_same(snapshot(resumed), snapshot(straight))
    assert losses(lockstep_steps(again, ctx_again, resumed, 3)) == losses(lockstep_steps(cfg, ctx, straight, 3))
    assert_same(snapshot(resumed), snapshot(straight))
