"""The opt-in modern recipe: the wsd schedule, Muon + AdamW as one optimizer, and their configs.

The faithful recipe (cosine, AdamW) is the default and stays bitwise what it was: the other test
files' trajectories cover it; here, the cosine values and the AdamW construction are compared
with what they were. The recipe itself: the schedule's shapes, the parameter split, an exact
state round trip, the NaN guard, exact resumes (1 process, 2 ranks, file and sharded), 1 process
against 2 ranks, and the refusal of a checkpoint written with the other optimizer (Muon on other
world sizes and strategies: tests/test_muon.py).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from conftest import (GPT2_VOCAB, REPO, base_args, build_tiny_run, lockstep_steps, make_shards, run_trainer, train_losses,
                      train_here)
from common.errors import ConfigError, NonFiniteLossError
from launch.config import TrainConfig, parse_args
from model import GPT
from training.optim.muon_with_adamw import MuonWithAdamW
from training.optim.optimizers import build_optimizer, optimizers, require_available
from training.optim.optimizers.muon import split_parameters
from training.checkpoint.format import with_current_settings
from training.optim.schedule import cooldown_start, learning_rate

MODERN = dict(optimizer="muon", lr_schedule="wsd", cooldown_frac=0.5, cooldown_shape="1-sqrt")


# --- the schedule ---------------------------------------------------------------------------------

def cosine_as_it_was(step, warmup_steps, max_steps, max_lr, min_lr):
    """training/optim/schedule.py's learning_rate before lr_schedule existed, verbatim."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


@pytest.mark.parametrize("warmup,steps,max_lr,min_lr", [(10, 100, 6e-4, 6e-5), (715, 19073, 6e-4, 6e-5),
                                                         (2, 6, 3e-3, 3e-4), (0, 7, 1.0, 0.0)])
def test_cosine_is_bitwise_the_schedule_it_was(warmup, steps, max_lr, min_lr):
    for step in range(steps + 3):
        expected = cosine_as_it_was(step, warmup, steps, max_lr, min_lr)
        assert learning_rate(step, warmup, steps, max_lr, min_lr) == expected
        assert learning_rate(step, warmup, steps, max_lr, min_lr, "cosine", 0.5, "1-sqrt") == expected


@pytest.mark.parametrize("shape", ["linear", "1-sqrt"])
def test_wsd_warms_up_holds_then_cools_down_continuously(shape):
    warmup, steps, max_lr, min_lr, frac = 10, 100, 6e-4, 6e-5, 0.2
    lr = [learning_rate(s, warmup, steps, max_lr, min_lr, "wsd", frac, shape) for s in range(steps + 5)]
    start = cooldown_start(steps, frac)
    assert start == 80
    assert lr[:warmup] == [cosine_as_it_was(s, warmup, steps, max_lr, min_lr) for s in range(warmup)]  # same warmup
    assert lr[warmup - 1] == max_lr and set(lr[warmup:start + 1]) == {max_lr}  # stable, into the cooldown's step 0
    cooldown = lr[start:steps + 1]
    assert all(a > b for a, b in zip(cooldown, cooldown[1:]))  # strictly down to min_lr at max_steps
    assert lr[steps] == min_lr and set(lr[steps:]) == {min_lr}
    # continuity after the warmup: no jump bigger than the cooldown's steepest step
    steepest = (max_lr - min_lr) * (1 / 20 if shape == "linear" else math.sqrt(1 / 20))
    after = lr[warmup - 1:]
    assert max(abs(a - b) for a, b in zip(after, after[1:])) <= steepest * (1 + 1e-9)
    middle = min_lr + (max_lr - min_lr) * (0.5 if shape == "linear" else 1 - math.sqrt(0.5))
    assert lr[start + 10] == pytest.approx(middle, rel=1e-12)


def test_wsd_with_the_whole_run_cooling_down_and_no_warmup():
    lr = [learning_rate(s, 0, 10, 1.0, 0.0, "wsd", 1.0, "linear") for s in range(11)]
    assert lr == pytest.approx([1 - s / 10 for s in range(11)], abs=1e-15)


# --- the configuration ----------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,message", [
    ({"lr_schedule": "step"}, "lr_schedule: unknown schedule 'step'; choose cosine, wsd"),
    ({"cooldown_shape": "cos"}, "cooldown_shape: unknown shape 'cos'; choose linear, 1-sqrt"),
    ({"cooldown_frac": 0.0}, "cooldown_frac: must be in (0, 1], got 0.0"),
    ({"cooldown_frac": 1.5}, "cooldown_frac: must be in (0, 1], got 1.5"),
    ({"lr_schedule": "wsd", "max_steps": 100, "warmup_steps": 90},
     "warmup_steps: 90 runs into the wsd cooldown, which starts at step 80"),
    ({"optimizer": "lion"}, "optimizer: unknown optimizer 'lion'; choose adamw, muon"),
    ({"muon_momentum": 1.0}, "muon_momentum: must be in [0, 1), got 1.0"),
    ({"muon_lr": -1.0}, "muon_lr: must be >= 0"),
    ({"muon_weight_decay": -0.1}, "muon_weight_decay: must be >= 0"),
    ({"optimizer": "muon", "max_lr": 0.0, "min_lr": 0.0}, "max_lr: must be positive with optimizer muon"),
])
def test_recipe_settings_are_checked_and_named(overrides, message):
    with pytest.raises(ConfigError) as caught:
        TrainConfig(**overrides)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_muon_on_a_torch_without_it_is_one_line_naming_the_version_it_needs(monkeypatch, capfd, tmp_path):
    """requirements.txt allows torch 2.4; torch.optim.Muon came in 2.9. The configuration is read before torch is
    imported, so this is checked once it is (require_available), before any work starts, and when an optimizer is
    built (a tool that builds one itself)."""

    monkeypatch.delattr(torch.optim, "Muon")
    muon = TrainConfig(optimizer="muon", model="custom", n_layer=1, n_head=1, n_embd=8)
    message = (f"optimizer: muon needs torch.optim.Muon, which PyTorch 2.9 added; this is torch {torch.__version__}: "
               f"upgrade torch (pip install 'torch>=2.9'), or use optimizer adamw")
    for check in (lambda: require_available(muon.optimizer),
                  lambda: build_optimizer(GPT(muon.model.model_config()), muon.optimizer, 1e-3, "cpu")):
        with pytest.raises(ConfigError) as caught:
            check()
        assert str(caught.value) == message
    data = make_shards(tmp_path / "shards")  # the trainer gets as far as the check: its inputs are there
    assert train_here(["--optimizer", "muon", "--data_dir", data, "--out_dir", tmp_path / "never-made"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("error: optimizer: muon needs torch.optim.Muon") and err.count("\n") == 1
    assert not (tmp_path / "never-made").exists()
    require_available(TrainConfig(optimizer="adamw").optimizer)  # the rest runs on such a torch


NEW_OPTIMIZER = """
from training.optim.optimizers import OptimizerEntry, register


def build(model, settings, peak_lr, device_type):
    import torch
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=peak_lr, momentum=settings.beta1)


register(OptimizerEntry("sgd", "SGD with momentum beta1", build))
"""


def test_a_new_optimizer_is_one_module_in_the_package(data, tmp_path, monkeypatch):
    """A module in training/optim/optimizers/ is all an optimizer needs to be validated, built and trained with (its
    entry registers it): here SGD, from a module in a folder added to the package's path."""
    import sys

    import training.optim.optimizers as package

    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "sgd.py").write_text(NEW_OPTIMIZER)
    with pytest.raises(ConfigError, match="unknown optimizer 'sgd'; choose adamw, muon"):
        TrainConfig(optimizer="sgd")
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path / "extra")])
    monkeypatch.setattr(package, "_ENTRIES", dict(package._ENTRIES))  # forgotten again after the test
    monkeypatch.delitem(sys.modules, "training.optim.optimizers.sgd", raising=False)
    assert list(optimizers()) == ["adamw", "muon", "sgd"]
    cfg, ctx, run = build_tiny_run(data, tmp_path / "run", optimizer="sgd")
    assert type(run.optimizer) is torch.optim.SGD and run.optimizer.defaults["momentum"] == cfg.optimizer.beta1
    before = [p.clone() for p in run.model.parameters()]
    (result,) = lockstep_steps(cfg, ctx, run, 1)
    assert math.isfinite(result.loss) and any(not torch.equal(a, b) for a, b in zip(before, run.model.parameters()))


def test_the_defaults_are_the_faithful_recipe():
    cfg = TrainConfig()
    assert (cfg.optimizer.optimizer, cfg.schedule.lr_schedule) == ("adamw", "cosine")


@pytest.mark.parametrize("size", ["124m", "350m"])
def test_the_modern_configs_parse_and_differ_from_the_faithful_ones_only_in_the_recipe(size):
    modern = parse_args(["--config", str(REPO / "configs" / f"gpt2_{size}_modern.yaml")]).to_dict()
    faithful = parse_args(["--config", str(REPO / "configs" / f"gpt2_{size}.yaml")]).to_dict()
    differ = {k for k in modern if modern[k] != faithful[k]}
    assert differ == {"out_dir", "optimizer", "lr_schedule", "cooldown_shape", "shuffle"}
    assert (modern["optimizer"], modern["lr_schedule"], modern["strategy"]) == ("muon", "wsd", "ddp")


# --- the optimizer, in this process ---------------------------------------------------------------

def test_muon_gets_exactly_the_blocks_matrices_and_adamw_everything_else_once(data, tmp_path):
    *_, run = build_tiny_run(data, tmp_path / "run", **MODERN)
    model, optimizer = run.model, run.optimizer
    assert isinstance(optimizer, MuonWithAdamW)
    grouped = [p for group in optimizer.param_groups for p in group["params"]]
    assert len(grouped) == len({id(p) for p in grouped}) == len(list(model.parameters()))  # each exactly once
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay, muon = ([names[id(p)] for p in g["params"]] for g in optimizer.param_groups)
    assert sorted(muon) == sorted(f"transformer.h.{i}.{m}" for i in range(2) for m in
                                  ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"))
    assert decay == ["transformer.wte.weight", "transformer.wpe.weight"]  # wte is lm_head (tied): once
    assert model.lm_head.weight is model.transformer.wte.weight
    assert all(p.dim() == 1 for p in optimizer.param_groups[1]["params"]) and len(no_decay) == 28 - 2 - 8
    assert [g["base_lr"] for g in optimizer.param_groups] == [3e-3, 3e-3, 0.02]
    assert split_parameters(model)[0] == optimizer.param_groups[2]["params"]


def test_adamw_is_build_nanogpts_configure_optimizers(data, tmp_path):
    """The faithful optimizer: AdamW with build-nanogpt's groups, in its order (every trainable parameter by name,
    the 2-D ones decayed), its betas, eps and lr; the same state dict as one made that way here."""
    cfg, ctx, run = build_tiny_run(data, tmp_path / "run")
    adamw, max_lr = cfg.optimizer, cfg.schedule.max_lr
    ours = build_optimizer(run.model, cfg.optimizer, max_lr, "cpu")
    params = [p for _, p in run.model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": adamw.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    theirs = torch.optim.AdamW(groups, lr=max_lr, betas=(adamw.beta1, adamw.beta2), eps=adamw.adam_eps, fused=False)
    assert type(run.optimizer) is type(ours) is torch.optim.AdamW
    assert ours.state_dict() == theirs.state_dict()
    assert [g["params"] for g in ours.param_groups] == [g["params"] for g in theirs.param_groups]
    assert all(p.dim() == 2 for p in groups[0]["params"]) and all(p.dim() == 1 for p in groups[1]["params"])
    assert sum(p.numel() for g in ours.param_groups for p in g["params"]) == run.model.num_params()


def test_the_schedule_scales_each_group_by_its_base_lr(data, tmp_path):
    cfg, ctx, run = build_tiny_run(data, tmp_path / "run", **MODERN)
    (result,) = lockstep_steps(cfg, ctx, run, 1)
    adamw, muon = run.optimizer.inner
    assert result.lr == 1.5e-3  # warmup step 0 of 2
    assert [g["lr"] for g in run.optimizer.param_groups] == [1.5e-3] * 3  # what the loop sets
    assert [g["lr"] for g in adamw.param_groups] == [1.5e-3, 1.5e-3]  # exactly the schedule's
    assert muon.param_groups[0]["lr"] == pytest.approx(0.01, rel=1e-15)  # muon_lr * 1.5e-3 / 3e-3
    assert adamw.state is muon.state is run.optimizer.state


def test_state_dict_round_trips_exactly_and_training_continues_the_same(data, tmp_path):
    cfg, ctx, run = build_tiny_run(data, tmp_path / "a", **MODERN)
    lockstep_steps(cfg, ctx, run, 2)
    saved = copy.deepcopy(run.optimizer.state_dict())
    weights = copy.deepcopy(run.model.state_dict())
    assert {k for s in saved["state"].values() for k in s} == {"step", "exp_avg", "exp_avg_sq", "momentum_buffer"}

    *_, other = build_tiny_run(data, tmp_path / "b", **MODERN)
    other.model.load_state_dict(weights)
    other.optimizer.load_state_dict(with_current_settings(copy.deepcopy(saved), other.optimizer))
    other.step = run.step
    again = other.optimizer.state_dict()
    without_lr = lambda groups: [{k: v for k, v in g.items() if k != "lr"} for g in groups]  # noqa: E731
    assert without_lr(again["param_groups"]) == without_lr(saved["param_groups"])  # lr: the loop sets it each step
    assert saved["state"].keys() == again["state"].keys()
    for index, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(value, again["state"][index][key]), (index, key)
    adamw, muon = other.optimizer.inner
    assert adamw.state is muon.state is other.optimizer.state  # re-linked after the load
    a = [r.loss for r in lockstep_steps(cfg, ctx, run, 2)]
    b = [r.loss for r in lockstep_steps(cfg, ctx, other, 2)]
    assert a == b
    for key, value in run.model.state_dict().items():
        assert torch.equal(value, other.model.state_dict()[key]), key


def test_a_nan_loss_stops_before_the_muon_update(data, tmp_path):
    cfg, ctx, run = build_tiny_run(data, tmp_path / "run", **MODERN)
    lockstep_steps(cfg, ctx, run, 2)
    with torch.no_grad():
        run.model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")
    weights = {k: v.clone() for k, v in run.model.state_dict().items()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in run.optimizer.state.items()}
    with pytest.raises(NonFiniteLossError, match="step 2: loss nan / grad norm nan is not finite; the update "
                                                 "was not applied"):
        lockstep_steps(cfg, ctx, run, 1)
    assert run.step == 2
    for key, value in run.model.state_dict().items():
        torch.testing.assert_close(value, weights[key], rtol=0, atol=0, equal_nan=True)
    assert len(run.optimizer.state) == 28
    for p, s in run.optimizer.state.items():  # Muon momentum buffers and AdamW moments untouched
        for key, value in s.items():
            assert torch.equal(value, state[id(p)][key]), key


# --- whole runs -----------------------------------------------------------------------------------

def args(data, out, **overrides):
    return base_args(data, out, **{**MODERN, **overrides})


@pytest.mark.slow
@pytest.mark.parametrize("nproc,fmt", [(None, "file"), (2, "file"), (2, "sharded")],
                         ids=["1proc-file", "2ranks-file", "2ranks-sharded"])
def test_a_modern_run_resumes_bitwise(data, tmp_path, nproc, fmt):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_trainer(args(data, straight, checkpoint_format=fmt), nproc=nproc)
    run_trainer(args(data, resumed, checkpoint_format=fmt, max_steps=5, final_checkpoint="false"), nproc=nproc)
    proc = run_trainer(args(data, resumed, checkpoint_format=fmt), nproc=nproc)  # from step 3
    assert "at step 3" in proc.stdout
    a, b = train_losses(straight), train_losses(resumed)
    assert sorted(a) == list(range(6)) and a == b  # bitwise
    assert a[5] < a[0]


@pytest.mark.slow
def test_one_process_and_two_ranks_agree(data, tmp_path):
    """In float64 (see tests/test_train_distributed.py): the ranks add gradients in another order.
    Muon's Newton-Schulz runs in bfloat16, whose rounding a ~1e-16 difference almost never crosses."""
    run_trainer(args(data, tmp_path / "ddp", dtype="float64"), nproc=2)
    run_trainer(args(data, tmp_path / "single", dtype="float64"))
    ddp, single = train_losses(tmp_path / "ddp"), train_losses(tmp_path / "single")
    assert sorted(ddp) == list(range(6))
    for step in range(6):
        assert abs(ddp[step] - single[step]) <= 1e-5 * abs(single[step])


@pytest.mark.slow
def test_a_checkpoint_resumes_only_with_the_optimizer_it_was_written_with(data, tmp_path):
    for written, then in (("muon", "adamw"), ("adamw", "muon")):
        out = tmp_path / written
        run_trainer(base_args(data, out, optimizer=written, max_steps=3, eval_interval=0))
        proc = run_trainer(base_args(data, out, optimizer=then, max_steps=6), check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
        assert errors[0].startswith(f"error: optimizer: {out / 'checkpoints' / 'step_00000003.pt'} was written "
                                    f"with optimizer {written}, this run uses {then}"), errors[0]
        assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_sharded_muon_checkpoint_consolidates_to_a_file_that_resumes_bitwise(data, tmp_path):
    """Consolidation keeps each of Muon + AdamW's groups, its parameters named in the optimizer's own order."""
    from training.checkpoint.folder import consolidate, list_checkpoints
    from training.distributed.strategies import parameter_names

    straight, resumed, file = tmp_path / "straight", tmp_path / "resumed", tmp_path / "step_00000003.pt"
    run_trainer(args(data, straight, checkpoint_format="sharded"), nproc=2)
    state = consolidate(dict(list_checkpoints(straight / "checkpoints"))[3], file)
    # in the order torch's own Optimizer.state_dict() numbers them: through its groups, in order
    names = [name for group in state["optimizer"]["param_groups"] for name in group["params"]]
    *_, fresh = build_tiny_run(data, tmp_path / "fresh", **MODERN)
    assert names == parameter_names(fresh.model, fresh.optimizer) and len(state["optimizer"]["param_groups"]) == 3
    run_trainer(args(data, resumed, checkpoint_format="sharded", resume=str(file)), nproc=2)
    assert train_losses(resumed) == {s: loss for s, loss in train_losses(straight).items() if s >= 3}


@pytest.mark.slow
def test_a_shuffled_run_resumes_bitwise_on_another_world_size_and_reads_other_rows(data, tmp_path):
    """The row order is a function of (seed, epoch): a 2-rank run stopped at step 3 continues in one
    process (float64, within the suite's DDP tolerance) through the same rows."""
    shuffled = dict(shuffle="true", dtype="float64")
    straight, resumed, ordered = tmp_path / "straight", tmp_path / "resumed", tmp_path / "ordered"
    run_trainer(args(data, straight, **shuffled))
    run_trainer(args(data, resumed, **shuffled, max_steps=5, final_checkpoint="false"), nproc=2)
    run_trainer(args(data, resumed, **shuffled))  # from step 3, in one process
    run_trainer(args(data, ordered, dtype="float64"))
    a, b = train_losses(straight), train_losses(resumed)
    assert sorted(b) == list(range(6))
    for step in range(6):
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step])
    assert train_losses(ordered)[0] != a[0]  # the first step already reads other rows


@pytest.mark.slow
def test_a_doc_aligned_run_trains_on_rows_that_start_at_documents(tmp_path):
    import numpy as np

    from data.shards import shard_name, write_shard
    from data.tokenizer import EOT_TOKEN

    rng = np.random.default_rng(0)
    folder = tmp_path / "docs"
    folder.mkdir()
    for index, split in enumerate(["val", "train", "train"]):
        docs = [np.concatenate([[EOT_TOKEN], rng.integers(0, 500, int(n))]) for n in rng.integers(5, 60, 150)]
        write_shard(folder / shard_name("docs", split, index), np.concatenate(docs).astype(np.uint16))
    proc = run_trainer(base_args(folder, tmp_path / "out", doc_aligned="true", vocab_size=GPT2_VOCAB, max_steps=3))
    assert "starting at documents:" in proc.stdout and "% of the tokens" in proc.stdout
    assert sorted(train_losses(tmp_path / "out")) == [0, 1, 2]
