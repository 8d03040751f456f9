"""The EMA of the weights (training/optim/ema.py): its math, its checkpoints, its evaluation, its readers.

The fast tests drive the step in this process; the slow ones launch the trainer (2 ranks, gloo).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import (REPO, base_args, build_tiny_run, crashed_copy, load_weights, lockstep_steps, run_trainer,
                      train_losses, untimed)
from common.errors import CheckpointError, ConfigError
from slowness import guard
from training.checkpoint.folder import list_checkpoints, read_full_state, read_model
from runtime.logger import read_log
from launch.config import parse_args
from launch.components import make_evaluation

DECAY = 0.9


def weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# --- settings ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value,message", [
    ("ema_decay", "1.0", "ema_decay: must be 0 (off) or in (0, 1), got 1.0"),
    ("ema_decay", "-0.5", "ema_decay: must be 0 (off) or in (0, 1), got -0.5"),
    ("ema_start", "1", "ema_start: must be in [0, 1), got 1.0"),
    ("ema_decay", "nan", "ema_decay: must be a finite number, got nan"),
])
def test_bad_values_are_one_line_naming_the_key(key, value, message):
    with pytest.raises(ConfigError) as e:
        parse_args([f"--{key}", value])
    assert str(e.value) == message


def test_the_keys_never_change_the_training_math():
    cfg = parse_args([])
    from common.settings import changes_training_math
    from launch.config import ON_RESUME_OF

    assert cfg.ema.ema_decay == 0
    assert not any(changes_training_math(ON_RESUME_OF[key], cfg.to_dict()) for key in ("ema_decay", "ema_start"))


# --- the math -----------------------------------------------------------------------------------------

def test_the_average_is_a_hand_computed_ema_of_the_weights_after_each_update_from_ema_start(shards, tmp_path):
    """max_steps 6, ema_start 0.34: the average starts as the weights after update 2, then lerps on."""
    cfg, ctx, run = build_tiny_run(shards, tmp_path / "run", ema_decay=DECAY, ema_start=0.34, dtype="float64")
    assert run.ema.start_step == 2
    expected, seen = {}, []

    def fold() -> None:
        step = run.step - 1
        seen.append(run.ema.ready)
        if step >= 2:
            now = weights(run.model)
            expected.update(now if step == 2 else {k: DECAY * expected[k] + (1 - DECAY) * now[k] for k in now})

    lockstep_steps(cfg, ctx, run, 5, fold)
    assert seen == [False, False, True, True, True] and run.ema.updates == 3
    assert run.ema.average.keys() == expected.keys()
    for name, value in run.ema.average.items():
        assert value.dtype == torch.float64  # float64 runs average in float64, others in float32
        torch.testing.assert_close(value, expected[name], rtol=1e-12, atol=1e-15)
        assert not torch.equal(value, run.model.get_parameter(name)), name  # it is not the live weights


def test_a_skipped_update_is_not_folded_in(shards, tmp_path):
    """float16's overflow skips the first update: the average starts from the second one's weights."""
    cfg, ctx, run = build_tiny_run(shards, tmp_path / "run", ema_decay=DECAY, dtype="float16")
    run.scaler.load_state_dict({**run.scaler.state_dict(), "scale": 2.0**100})  # every gradient overflows
    lockstep_steps(cfg, ctx, run, 1)
    assert run.step == 1 and not run.ema.ready
    run.scaler.update(2.0**16)
    lockstep_steps(cfg, ctx, run, 1)
    assert run.ema.updates == 1
    for name, value in run.ema.average.items():
        assert torch.equal(value, run.model.get_parameter(name).float()), name
        assert value.dtype == torch.float32


def test_ema_off_keeps_no_average_and_writes_no_entry(shards, tmp_path):
    cfg, ctx, run = build_tiny_run(shards, tmp_path / "run")
    assert run.ema is None and not {"ema", "ema_state"} & (run.parts().keys() | run.state_dict().keys())


# --- evaluation -----------------------------------------------------------------------------------------

def test_evaluating_the_average_leaves_the_live_weights_and_the_average_bitwise_unchanged(shards, tmp_path):
    from evals.val_loss import evaluate_val_loss

    cfg, ctx, run = build_tiny_run(shards, tmp_path / "run", ema_decay=DECAY, eval_interval=1)
    lockstep_steps(cfg, ctx, run, 3)
    live, average = weights(run.model), {k: v.clone() for k, v in run.ema.average.items()}
    logged = []
    ctx.logger.log = logged.append  # the silent logger, listened to
    make_evaluation(cfg, ctx, run.strategy, tokenizer=None).run_due(run, last_step=False, agree_to_stop=lambda: False)
    for name, value in weights(run.model).items():
        assert torch.equal(value, live[name]), name
    for name, value in run.ema.average.items():
        assert torch.equal(value, average[name]), name
    (record,) = logged
    assert record["kind"] == "val" and record["step"] == 3 and record["ema_loss"] != record["loss"]
    assert run.metrics["ema_val_loss"] == record["ema_loss"]
    # the figure is that of a model holding the average
    with torch.no_grad():
        for name, p in run.model.named_parameters():
            p.copy_(average[name])
    assert evaluate_val_loss(run.model, run.val_loader, ctx.env, ctx.runtime.autocast()) == record["ema_loss"]


def test_hellaswag_of_the_average_is_its_own_field(shards, tmp_path):
    from conftest import GPT2_VOCAB
    from data.tokenizer import get_tokenizer
    from evals.hellaswag import HellaSwag
    from test_hellaswag import write_fixture

    fixture = write_fixture(tmp_path / "hellaswag.jsonl", n=8)
    cfg, ctx, run = build_tiny_run(shards, tmp_path / "run", ema_decay=0.5, vocab_size=GPT2_VOCAB, max_steps=2,
                                   hellaswag_interval=1, hellaswag_path=fixture)
    lockstep_steps(cfg, ctx, run, 2)
    logged = []
    ctx.logger.log = logged.append
    evaluation = make_evaluation(cfg, ctx, run.strategy, get_tokenizer())
    evaluation.evaluators = [e for e in evaluation.evaluators if isinstance(e, HellaSwag)]
    live = weights(run.model)
    evaluation.run_due(run, last_step=True, agree_to_stop=lambda: False)
    (record,) = logged
    assert {"acc_norm", "acc", "n", "ema_acc_norm", "ema_acc"} <= record.keys() and "ema_n" not in record
    assert run.metrics["ema_hellaswag_acc_norm"] == record["ema_acc_norm"]
    assert all(torch.equal(p, live[name]) for name, p in run.model.named_parameters())


def test_no_average_is_evaluated_before_ema_start(shards, tmp_path):
    cfg, ctx, run = build_tiny_run(shards, tmp_path / "run", ema_decay=DECAY, ema_start=0.5)
    lockstep_steps(cfg, ctx, run, 2)
    logged = []
    ctx.logger.log = logged.append
    make_evaluation(cfg, ctx, run.strategy, tokenizer=None).run_due(run, last_step=True, agree_to_stop=lambda: False)
    assert [sorted(r) for r in logged] == [["bpb", "kind", "loss", "step", "tokens"]]


# --- checkpoints, resume and the readers (processes) ------------------------------------------------------

EMA = dict(ema_decay=DECAY, ema_start=0.2)  # starts at update 1 of 6
F64 = dict(dtype="float64")


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory) -> dict[str, Path]:
    """Uninterrupted 6-step runs: 2-rank ddp (file) and fsdp (sharded) with EMA, in float32 and float64;
    a 1-process run without and with EMA."""
    root = tmp_path_factory.mktemp("straight")
    out = {}
    for name, strategy, extra, nproc in [("ddp", "ddp", {}, 2), ("fsdp", "fsdp", {}, 2),
                                         ("ddp64", "ddp", F64, 2), ("fsdp64", "fsdp", F64, 2)]:
        out[name] = root / name
        run_trainer(base_args(data, out[name], strategy=strategy, **EMA, **extra), nproc=nproc)
    for name, extra in [("off", {}), ("on", EMA)]:
        out[name] = root / name
        run_trainer(base_args(data, out[name], **extra))
    return out


def averages(out_dir: Path, step: int) -> dict[str, torch.Tensor]:
    (path,) = [p for s, p in list_checkpoints(out_dir / "checkpoints") if s == step]
    return read_full_state(path)["ema"]


def val_records(out_dir: Path) -> list[dict]:
    """The run's val records, less the time each was written (which two runs of the same steps never share)."""
    return untimed(r for r in read_log(out_dir / "log.jsonl") if r["kind"] == "val")


@pytest.mark.slow
def test_ema_on_trains_bitwise_like_ema_off(straight):
    """The average never feeds back: the same losses and weights, bitwise; a run without it saves no entry."""
    assert train_losses(straight["on"]) == train_losses(straight["off"])
    on, off = load_weights(straight["on"], 6), load_weights(straight["off"], 6)
    assert all(torch.equal(on[k], off[k]) for k in off)
    assert [r["loss"] for r in val_records(straight["on"])] == [r["loss"] for r in val_records(straight["off"])]
    assert [sorted(k for k in r if k.startswith("ema_")) for r in val_records(straight["on"])] == [
        [], ["ema_bpb", "ema_loss"], ["ema_bpb", "ema_loss"]]
    assert "ema" not in read_full_state(straight["off"] / "checkpoints" / "step_00000006.pt")


def resume_from_step_3(source: Path, out: Path, data: Path, nproc, **settings) -> None:
    crashed_copy(source, out, 3)
    run_trainer(base_args(data, out, **EMA, **settings), nproc=nproc)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_two_rank_resume_is_bitwise(straight, data, tmp_path, strategy):
    out = tmp_path / "resumed"
    resume_from_step_3(straight[strategy], out, data, 2, strategy=strategy)
    assert train_losses(out) == train_losses(straight[strategy])
    assert val_records(out) == val_records(straight[strategy])  # ema_loss at step 6 included
    a, b = averages(out, 6), averages(straight[strategy], 6)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["transformer.wte.weight"].dtype == torch.float32


@pytest.mark.slow
@pytest.mark.parametrize("strategy,then,nproc", [("ddp", "ddp", None), ("fsdp", "ddp", None), ("ddp", "fsdp", 2)],
                         ids=["ddp-file-to-1-process", "fsdp-sharded-to-1-process", "ddp-file-to-fsdp-shards"])
def test_a_resume_on_another_world_size_or_strategy_matches_within_tolerance(straight, data, tmp_path, strategy,
                                                                             then, nproc):
    """2 ranks -> 1 process (a fsdp run's sharded checkpoint, a ddp run's file), and a whole file's average cut
    into FSDP shards; float64, as test_fsdp."""
    out = tmp_path / "resumed"
    resume_from_step_3(straight[f"{strategy}64"], out, data, nproc, strategy=then, **F64)
    a, b = averages(out, 6), averages(straight[f"{strategy}64"], 6)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.linalg.norm(a[key] - b[key]) <= 1e-12 * torch.linalg.norm(b[key]), key
    ema = [r["ema_loss"] for r in val_records(out)[-1:]] + [r["ema_loss"] for r in val_records(straight[f"{strategy}64"])[-1:]]
    assert abs(ema[0] - ema[1]) <= 1e-12 * ema[1]


@pytest.mark.slow
def test_turning_ema_on_at_a_resume_starts_it_fresh_with_a_warning(straight, data, tmp_path):
    """The average starts at the update of the checkpoint's step 3 (not at update 1, which the config's ema_start
    would give a fresh run): the warning, the start the checkpoints store and the exported model card say 3."""
    from hf_interop.export import model_card
    from model import GPTConfig
    from training.checkpoint.folder import with_average

    out = tmp_path / "resumed"
    crashed_copy(straight["off"], out, 3)
    proc = run_trainer(base_args(data, out, **EMA))
    assert "holds no EMA of the weights" in proc.stderr and "from the weights of step 3, not of step 1" in proc.stderr
    assert train_losses(out) == train_losses(straight["off"])
    state = read_full_state(out / "checkpoints" / "step_00000006.pt")
    assert state["ema_state"] == {"decay": DECAY, "start_step": 3, "updates": 3}
    card = model_card(with_average(state), GPTConfig(**state["model_args"]), 10, Path("hf/x"), "mit")
    assert "(ema_decay 0.9, from update 3, 3 updates)" in card


@pytest.mark.slow
@pytest.mark.parametrize("source", ["on", "fsdp"], ids=["file", "sharded"])
def test_readers_take_the_ema_weights(straight, tmp_path, source, monkeypatch):
    """read_model (sample.py, eval_lm.py) and export_hf.py --weights ema give the average; none is an error."""
    ckpt = straight[source] / "checkpoints" / (f"step_{6:08d}" + (".pt" if source == "on" else ""))
    average = averages(straight[source], 6)
    model, state, _ = read_model(ckpt, "sample.py", "ema")
    for name, p in model.named_parameters():
        assert torch.equal(p, average[name]), name
    assert torch.equal(model.lm_head.weight, average["transformer.wte.weight"])  # tied
    live, _, _ = read_model(ckpt, "sample.py")
    assert not torch.equal(live.lm_head.weight, model.lm_head.weight)
    with pytest.raises(CheckpointError, match="checkpoint has no EMA weights"):
        read_model(straight["off"], "sample.py", "ema")
    # export_hf.py: the state it exports (the tiny model's 512-row vocabulary is no HF GPT-2: captured before)
    import export_hf

    exported = {}
    monkeypatch.setattr(export_hf, "export_hf", lambda state, out_dir, license: exported.update(state) or out_dir)
    assert export_hf.main([str(ckpt), str(tmp_path / "hf"), "--weights", "ema"]) == 0
    for name, value in average.items():
        assert torch.equal(exported["model"][name], value), name
    assert torch.equal(exported["model"]["lm_head.weight"], average["transformer.wte.weight"])
    with pytest.raises(CheckpointError, match="checkpoint has no EMA weights"):
        export_hf.main([str(straight["off"]), str(tmp_path / "hf"), "--weights", "ema"])


def test_the_model_card_of_exported_ema_weights_says_so_and_gives_their_own_val_loss():
    """export_hf.py --weights ema: the card says the weights are the EMA, its val_loss is the EMA's, and the live
    weights' figure is marked live_; the live export's card is as before."""
    from hf_interop.export import model_card
    from model import GPTConfig
    from training.checkpoint.folder import with_average

    w = torch.zeros(2)
    state = {"model": {"a": w}, "ema": {"a": w + 1}, "step": 6, "tokens_seen": 3072, "config": {"ema_decay": DECAY},
             "metrics": {"val_loss": 5.25, "ema_val_loss": 4.75},
             "ema_state": {"decay": DECAY, "start_step": 1, "updates": 5}}
    config = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64)
    card = model_card(with_average(state), config, 10, Path("hf/x"), "mit")
    assert "The weights are the exponential moving average (EMA) of the trained weights (ema_decay 0.9, from " \
           "update 1, 5 updates), not the weights after the last step." in card
    assert "| val_loss | 4.7500 |" in card and "| live_val_loss | 5.2500 |" in card and "5.2500 |\n| ema" not in card
    live = model_card(state, config, 10, Path("hf/x"), "mit")
    assert "| val_loss | 5.2500 |" in live and "| ema_val_loss | 4.7500 |" in live and "moving average" not in live


@pytest.mark.slow
def test_sample_with_ema_weights_and_its_error_without_them(straight):
    import sample

    model, what = sample.load_model(str(straight["on"]), torch.device("cpu"), "ema")
    assert what.endswith("(EMA weights)") and torch.equal(model.lm_head.weight,
                                                          averages(straight["on"], 6)["transformer.wte.weight"])
    missing = subprocess.run([sys.executable, str(REPO / "sample.py"), "--ckpt", str(straight["off"]), "--weights",
                              "ema", "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=guard(120))
    assert missing.returncode == 2
    (line,) = missing.stderr.strip().splitlines()
    assert line.startswith("error: ") and "has no EMA weights" in line


@pytest.mark.slow
def test_fsdp_zero2_evaluates_the_average_and_trains_on_as_fsdp(straight, data, tmp_path):
    """fsdp_zero2 keeps a block's parameters gathered after a forward without a backward (an evaluation's): the
    average is swapped with the shards all the same, and the step after the evaluations trains on the live weights
    (gathered again from the shards), so the run is fsdp's, bitwise: its losses, its val and EMA val records, its
    average."""
    out = tmp_path / "zero2"
    run_trainer(base_args(data, out, strategy="fsdp_zero2", **EMA), nproc=2)
    assert train_losses(out) == train_losses(straight["fsdp"])
    assert val_records(out) == val_records(straight["fsdp"]) and "ema_loss" in val_records(out)[-1]
    a, b = averages(out, 6), averages(straight["fsdp"], 6)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def tail_average(data, tmp_path_factory) -> Path:
    """8 steps, an EMA of the second half (it starts at update 4), checkpoints every 2 steps."""
    out = tmp_path_factory.mktemp("tail") / "run"
    run_trainer(base_args(data, out, max_steps=8, checkpoint_interval=2, eval_interval=4, ema_decay=DECAY,
                          ema_start=0.5))
    return out


def ema_state(out_dir: Path, step: int) -> dict:
    (path,) = [p for s, p in list_checkpoints(out_dir / "checkpoints") if s == step]
    return read_full_state(path)["ema_state"]


@pytest.mark.slow
def test_a_raised_max_steps_keeps_the_started_average_folding_from_its_own_start(tail_average, data, tmp_path):
    """Resumed at step 6 (the average holds updates 4 and 5) with max_steps 16: the start stays 4 (not 8, which
    ema_start 0.5 of 16 gives), so updates 6 and 7 are folded in, and the warning says where it started."""
    out = crashed_copy(tail_average, tmp_path / "raised", 6)
    assert ema_state(out, 6) == {"decay": DECAY, "start_step": 4, "updates": 2}
    proc = run_trainer(base_args(data, out, max_steps=16, checkpoint_interval=2, eval_interval=4, ema_decay=DECAY,
                                 ema_start=0.5))
    assert ema_state(out, 8) == {"decay": DECAY, "start_step": 4, "updates": 4}
    assert "the EMA of the weights started at step 4 and averages on from there (ema_start 0.5 of max_steps 16 " \
           "would start a fresh run's at step 8)" in proc.stderr
    assert [r["step"] for r in val_records(out) if "ema_loss" in r] == [8, 12, 16]


@pytest.mark.slow
@pytest.mark.parametrize("older", [False, True], ids=["saved-start", "older-checkpoint"])
def test_a_resume_before_the_average_started_keeps_its_start_and_says_so_truly(tail_average, data, tmp_path, older):
    """Resumed at step 2 (the EMA of a run with ema_decay 0.9 has not started: it starts at 4) with max_steps 3: the
    start stays 4, past the run's end, and the warning says so, not that the run had no EMA. A checkpoint of older
    code, which saved no ema_state before the start, gives the same start through its own config."""
    out = crashed_copy(tail_average, tmp_path / "lowered", 2)
    assert ema_state(out, 2) == {"decay": DECAY, "start_step": 4, "updates": 0}
    if older:
        path = out / "checkpoints" / "step_00000002.pt"
        state = torch.load(path, weights_only=True)
        state["ema_state"] = None
        torch.save(state, path)
    proc = run_trainer(base_args(data, out, max_steps=3, checkpoint_interval=2, eval_interval=4, ema_decay=DECAY,
                                 ema_start=0.5))
    assert "ema_decay 0" not in proc.stderr
    assert "the EMA of the weights starts at step 4, as the run of" in proc.stderr and \
           "at or after max_steps 3: this run ends without one" in proc.stderr
    assert ema_state(out, 3) == {"decay": DECAY, "start_step": 4, "updates": 0}
    assert "ema_loss" not in val_records(out)[-1]
