"""ladder.py: the plan (sizes, budgets, FLOPs as the trainer counts them), its refusals, the dry run, and a shrunk
ladder trained end to end, then killed mid-rung and run again: it must end as the uninterrupted one, bit for bit."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

import ladder
from common.errors import ConfigError, run_cli
from PIL import Image
from plot_log import describe
from conftest import (LAUNCH_TOKEN, REPO, TINY_VOCAB, kill_all, launched_processes, load_weights, make_shards,
                      run_and_reap, trainer_env, train_losses, wait_until)
from model import GPT, PRESETS, GPTConfig
from runtime.logger import read_log
from launch.config import TrainConfig
from scaling_ladder.plan import Rung, ladder_sizes, plan
from scaling_ladder.report import write_report
from scaling_ladder.runs import write_rung_config


def planned(*argv: str) -> list[Rung]:
    args = ladder.parse(list(argv))
    return plan(args, *ladder_sizes(args))


# --- the plan ----------------------------------------------------------------------------------------------

def test_depth_12_is_gpt2_and_flops_are_counted_as_the_trainers_mfu(tmp_path):
    rungs = planned("--config", "configs/gpt2_124m.yaml", "--depths", "6", "12", "--out", str(tmp_path))
    d6, d12, d18 = rungs
    with torch.device("meta"):
        gpt2 = GPT(GPTConfig(**PRESETS["gpt2"]))
    assert d12.params == gpt2.num_params(non_embedding=True)  # GPT-2 124M
    assert d18.check and d18.size.label == "d18" and not d12.check  # the next depth by the last step, 6
    for rung in rungs:
        cfg = TrainConfig(**yaml.safe_load(rung.config))  # the rung's complete config, as the trainer reads it
        assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd) == (int(rung.size.label[1:]),) * 2 + (
            64 * int(rung.size.label[1:]),)
        with torch.device("meta"):
            model = GPT(cfg.model.model_config())
        assert rung.flops_per_token == model.estimate_flops_per_token(cfg.data.seq_len)  # what train_gpt2.py's MFU uses
        assert rung.max_steps == round(20 * rung.params / 524288) == cfg.schedule.max_steps
        assert rung.tokens == cfg.schedule.max_steps * 524288 and rung.flops == rung.flops_per_token * rung.tokens
        assert cfg.schedule.warmup_steps == round(715 * rung.max_steps / 19073)  # the base's share of its steps
        assert cfg.checkpoint.checkpoint_interval == math.ceil(rung.max_steps / 4)
        assert cfg.run.out_dir == str(tmp_path / rung.name) and cfg.runtime.seed == 1337


def test_flop_budgets_recipes_seeds_and_presets(tmp_path):
    rungs = planned("--config", "configs/gpt2_124m.yaml", "--presets", "gpt2", "gpt2-medium", "--flops", "1e18", "4e18",
                    "--seeds", "1", "2",
                    "--recipes", "faithful,modern", "--set", "max_lr=1e-3", "--out", str(tmp_path))
    assert [r.name for r in rungs[:4]] == ["gpt2_faithful_s1", "gpt2_modern_s1", "gpt2_faithful_s2", "gpt2_modern_s2"]
    large = [r for r in rungs if r.check]
    assert {r.size.label for r in large} == {"gpt2-large"} and len(large) == 4  # the next preset
    for rung in rungs:
        budget = {"gpt2": 1e18, "gpt2-medium": 4e18, "gpt2-large": 16e18}[rung.size.label]  # and the ratio once more
        assert rung.max_steps == round(budget / rung.flops_per_token / 524288)
        cfg = yaml.safe_load(rung.config)
        assert cfg["model"] == rung.size.label and cfg["max_lr"] == 1e-3 and cfg["seed"] == rung.seed
        modern = {"optimizer": "muon", "lr_schedule": "wsd", "cooldown_shape": "1-sqrt", "shuffle": True}
        assert all((cfg[k] == v) == (rung.recipe == "modern") for k, v in modern.items()), cfg


@pytest.mark.parametrize("argv, message", [
    (["--set", "max_steps=5"], "--set: max_steps is set per rung by the ladder"),
    (["--set", "max_lr"], "--set: expected KEY=VALUE"),
    (["--set", "max_lrr=1"], "max_lrr: unknown config key"),
    (["--set", "max_lr=fast"], "max_lr: expected a number"),
    (["--depths", "3", "2"], "--depths: increasing positive depths"),
    (["--next", "3"], "--next: d3 is a size of the ladder"),
    (["--presets", "gpt2-xl"], "--next: no preset after gpt2-xl"),
    (["--presets", "gpt2", "--next", "gpt3"], "--next: unknown preset 'gpt3'"),
    (["--recipes", "faithful,fast"], "--recipes: one or two of faithful, modern"),
    (["--flops", "1e15", "2e15", "3e15", "4e15", "5e15", "6e15"], "--flops: one budget per size (4)"),
    (["--config", "configs/none.yaml"], "--config: no such file"),
    (["--dry_run", "--hardware", "Z80"], "--hardware: 'Z80' is not in the peak FLOP/s table"),
])
def test_a_bad_argument_is_one_error_line(argv, message, tmp_path, capfd):
    assert run_cli(ladder.main, [*argv, "--out", str(tmp_path / "out")]) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_a_rung_config_that_differs_from_its_folders_is_refused(tmp_path):
    (rung,) = [r for r in planned("--depths", "1", "2", "3", "--out", str(tmp_path)) if r.name == "d1_faithful_s1337"]
    write_rung_config(rung, tmp_path)
    assert write_rung_config(rung, tmp_path).read_text() == rung.config  # the same: fine
    (other,) = [r for r in planned("--depths", "1", "2", "3", "--tokens_per_param", "10", "--out", str(tmp_path))
                if r.name == "d1_faithful_s1337"]
    with pytest.raises(ConfigError, match=r"rung d1_faithful_s1337 was set up with other settings \(max_steps: "):
        write_rung_config(other, tmp_path)


def test_the_dry_run_on_gpus_is_the_trainers_estimate_of_each_rung(tmp_path, capsys):
    """Each rung's time is what train_gpt2.py --estimate prints as the hours of that rung's own config on the same
    GPUs (steps, evaluations, checkpoints, start-up), and the speed's source is stated; nothing trains."""
    import train_gpt2

    out = tmp_path / "out"
    argv = ["--config", "configs/gpt2_124m.yaml", "--depths", "3", "4", "6", "8", "--next", "12", "--hardware", "H100",
            "--gpus", "8", "--dry_run", "--out", str(out)]
    assert ladder.main(argv) == 0
    text = capsys.readouterr().out
    assert "- 8 x H100: assumed: MFU 40%" in text and "x H100's bf16 peak of 989 TFLOP/s" in text
    assert "6N + 12 L H Q T" in text.replace("6 N", "6N") and "| d12_faithful_s1337 (check) |" in text
    for rung in planned(*argv):
        (row,) = [line for line in text.splitlines() if line.startswith(f"| {rung.name}")]
        assert f"| {rung.params:,} | {rung.max_steps:,} | {rung.tokens:,} |" in row and f"| {rung.flops:.3e} |" in row
        config = tmp_path / f"{rung.name}.yaml"
        config.write_text(rung.config)
        assert run_cli(train_gpt2.main, ["--config", str(config), "--estimate", "--gpu", "H100", "--gpus", "8"]) == 0
        (hours,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("hours ")]
        assert hours.split(None, 1)[1].startswith(f"{row.split('|')[-2].strip()} "), (row, hours)
    assert not out.exists()


# --- a shrunk ladder, trained ---------------------------------------------------------------------------------

# Three depths of the tiny vocabulary (1-3 layers, 64-192 wide) and the next, d4, each a few steps of 512 tokens:
# 6, 10, 24 and 13 steps (budgets for those, --flops); d3 saves a checkpoint every 6 steps.
FLOPS = ["1.6e9", "1.5e10", "1.1e11", "1.3e11"]
STEPS = {"d1_faithful_s1": 6, "d2_faithful_s1": 10, "d3_faithful_s1": 24, "d4_faithful_s1": 13}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ladder_base")
    data = make_shards(root / "shards", train_sizes=(6000, 6000))
    config = {"data_dir": str(data), "vocab_size": TINY_VOCAB, "block_size": 32, "seq_len": 32, "micro_batch_size": 16,
              "total_batch_size": 512, "max_steps": 20, "warmup_steps": 2, "max_lr": 3e-3, "min_lr": 3e-4,
              "eval_interval": 0, "val_tokens": 512, "hellaswag_interval": 0, "sample_interval": 0, "device": "cpu",
              "dtype": "float32", "compile": False, "log_interval": 1000, "keep_last": 2}
    (root / "tiny.yaml").write_text(yaml.safe_dump(config))
    return root / "tiny.yaml"


def ladder_command(base: Path, out: Path, *more: str) -> list[str]:
    return [sys.executable, str(REPO / "ladder.py"), "--config", str(base), "--depths", "1", "2", "3", "--next", "4",
            "--flops", *FLOPS, "--seeds", "1", "--bootstrap", "200", "--out", str(out), *more]


@dataclass
class Straight:
    out: Path
    stdout: str


@pytest.fixture(scope="module")
def straight(base, tmp_path_factory) -> Straight:
    """The shrunk ladder, uninterrupted, with --check: the three rungs, the fit and its prediction, then the fourth
    rung. The reference."""
    out = tmp_path_factory.mktemp("straight") / "ladder"
    proc = run_and_reap(ladder_command(base, out, "--check"), trainer_env(), timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Straight(out, proc.stdout)


@pytest.mark.slow
def test_a_shrunk_ladder_trains_fits_predicts_and_checks(straight, tmp_path):
    out, stdout = straight.out, straight.stdout
    data = yaml.safe_load((out / "ladder.json").read_text())
    assert {r["name"]: r["max_steps"] for r in data["rungs"]} == STEPS
    for rung in data["rungs"]:
        records = read_log(out / rung["name"] / "log.jsonl")
        final = [r for r in records if r["kind"] == "val" and r["step"] == rung["max_steps"]]
        assert final and rung["final"] == {"loss": final[0]["loss"], "bpb": final[0]["bpb"]}
        assert (out / rung["name"] / "config.yaml").exists()  # an ordinary run folder, from its own config:
        assert f"train_gpt2.py --config {out / 'configs' / rung['name']}.yaml" in stdout
    fit = data["fits"]["faithful"]["loss"]
    assert fit["runs"] == 3 and fit["budgets"] == 3 and fit["bootstrap_replicates"] == 0  # 3 runs: no residual left
    assert fit["prediction"]["size"] == "d4" and fit["prediction"]["run_interval"] is None
    (checked,) = fit["check"]["runs"]
    assert checked["name"] == "d4_faithful_s1" and checked["value"] == data["rungs"][3]["final"]["loss"]
    assert fit["check"]["mean_error"] == pytest.approx(checked["value"] - fit["prediction"]["value"])
    text = (out / "ladder.md").read_text()
    assert "Predicted for d4" in text and "Trained (d4): seed 1" in text and "6 N + 12 L H Q T" in text
    launched = [line for line in stdout.splitlines() if line.startswith("ladder: rung")]
    assert [line.split(": ")[2].split(",")[0] for line in launched] == list(STEPS)
    assert launched[-1].startswith("ladder: rung 1/1: d4_faithful_s1")  # --check's own launch, after the ladder's
    # the prediction was written before d4 trained
    assert stdout.index("holds the prediction for d4 before it trains") < stdout.index("rung 1/1: d4_faithful_s1")
    assert (out / "ladder.png").read_bytes()[:4] == b"\x89PNG"
    # ladder.json alone draws it again, to the byte (the law refitted without replicates: 3 runs)
    ladder.redraw(json.loads((out / "ladder.json").read_text()), tmp_path / "redrawn.png")
    assert (tmp_path / "redrawn.png").read_bytes() == (out / "ladder.png").read_bytes()


@pytest.mark.slow
def test_a_ladder_killed_mid_rung_resumes_and_ends_as_the_uninterrupted_one_bitwise(base, straight, tmp_path):
    """Killed in d3, its d1 and d2 finished (the reference's, copied: a killed ladder's finished rungs are read, not
    trained again), then the same command again: it resumes d3, trains d4 (--check), and ends as the reference."""
    out = tmp_path / "ladder"
    for rung in list(STEPS)[:2]:
        shutil.copytree(straight.out / rung, out / rung)
    command = ladder_command(base, out, "--check")
    token = uuid.uuid4().hex
    proc = subprocess.Popen(command, cwd=REPO, env={**trainer_env(), LAUNCH_TOKEN: token}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    log = out / "d3_faithful_s1" / "log.jsonl"
    wait_until(lambda: log.exists() and any(r["kind"] == "checkpoint" for r in read_log(log)), proc,
               "d3's first checkpoint")
    kill_all(launched_processes(token))  # the ladder and its rung at once, as a lost machine would stop them
    first = proc.communicate()[0]
    assert not any(r["kind"] == "val" for r in read_log(log)), "the rung finished before the kill"
    assert [line for line in first.splitlines() if line.startswith("ladder: rung")] == [
        "ladder: rung 1/1: d3_faithful_s1, 1,433,280 parameters, 12,288 tokens, 1.084e+11 FLOPs"], first[-3000:]

    again = run_and_reap(command, trainer_env(), timeout=120)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    launched = [line for line in again.stdout.splitlines() if line.startswith("ladder: rung")]
    assert launched == ["ladder: rung 1/1 (resuming): d3_faithful_s1, 1,433,280 parameters, 12,288 tokens, "
                        "1.084e+11 FLOPs", "ladder: rung 1/1: d4_faithful_s1, 3,290,624 parameters, 6,656 tokens, "
                        "1.340e+11 FLOPs"], launched  # d1 and d2 read, not trained again
    assert "resumed from" in again.stdout
    for name in ("ladder.json", "ladder.md"):
        assert (out / name).read_bytes() == (straight.out / name).read_bytes(), name
    for rung, steps in STEPS.items():
        assert train_losses(out / rung) == train_losses(straight.out / rung), rung
        a, b = load_weights(out / rung, steps), load_weights(straight.out / rung, steps)
        assert all(torch.equal(a[k], b[k]) for k in a), rung


def test_two_recipes_are_compared_size_by_size_and_their_gain_traced_with_scale(tmp_path):
    """Run folders whose final val records follow two laws, modern's gain growing with compute: per size
    compare_runs.py's Welch test, the slope of modern - faithful against log10 C with its interval, a law and a
    prediction per recipe, and both in the picture. (No training: the figures are written as the trainer logs them.)"""
    argv = ["--depths", "1", "2", "3", "4", "--tokens_per_param", "0.01", "--seeds", "1", "2", "--recipes",
            "faithful,modern", "--out", str(tmp_path), "--bootstrap", "300"]
    args = ladder.parse(argv)
    sizes, next_size = ladder_sizes(args)
    rungs = plan(args, sizes, next_size)
    for rung in rungs:
        if rung.check:
            continue
        scale = rung.flops / rungs[0].flops
        loss = 3.0 + 4.0 * scale ** -0.3 - (0.05 * math.log10(scale) if rung.recipe == "modern" else 0.0)
        loss += 0.003 * (1 if rung.seed == 1 else -1)
        (tmp_path / rung.name).mkdir()
        record = {"kind": "val", "step": rung.max_steps, "loss": loss, "bpb": loss / 2.3}
        (tmp_path / rung.name / "log.jsonl").write_text(json.dumps(record) + "\n")
    text = write_report(args, rungs, sizes)
    data = yaml.safe_load((tmp_path / "ladder.json").read_text())
    comparison = data["comparison"]
    assert [s["size"] for s in comparison["sizes"]] == ["d1", "d2", "d3", "d4"]  # d5 was not trained
    d4 = comparison["sizes"][-1]["rows"]["final val loss"]
    assert d4["difference"] == pytest.approx(-0.05 * math.log10(rungs[-4 - 4].flops / rungs[0].flops))
    assert d4["verdict"].startswith("modern is better at p =")
    slope = comparison["trends"]["final val loss"]
    assert slope["slope_per_decade"] == pytest.approx(-0.05) and slope["interval"][1] < 0
    assert "it moves in modern's favour as the compute grows" in text
    for recipe in ("faithful", "modern"):
        fit = data["fits"][recipe]["loss"]
        assert fit["runs"] == 8 and fit["prediction"]["size"] == "d5" and fit["check"] is None
    assert data["fits"]["faithful"]["loss"]["law"]["alpha"] == pytest.approx(0.3, rel=0.02)
    assert (tmp_path / "ladder.png").stat().st_size > 10_000
    # ladder.json alone draws the picture again, to the byte (each recipe's law refitted with its 300 replicates),
    # as scripts/pictures.py draws docs/ladder.png; the PNG says what it draws
    fig = ladder.redraw(json.loads((tmp_path / "ladder.json").read_text()), tmp_path / "redrawn.png")
    assert (tmp_path / "redrawn.png").read_bytes() == (tmp_path / "ladder.png").read_bytes()
    with Image.open(tmp_path / "ladder.png") as image:
        assert image.text["Description"] == describe(fig)
    assert "collection 'faithful: rungs'" in describe(fig) and "collection 'modern: rungs'" in describe(fig)
