"""The estimate before a run (launch/estimate.py, train_gpt2.py --estimate): its arithmetic against the real model,
a real checkpoint and hand-derived figures for the 124M config, what it prints, and its refusals."""

from __future__ import annotations

import ast
import math
import re

import pytest
import torch

import launch.estimate as est
import train_gpt2
from common.errors import run_cli
from conftest import REPO, build_tiny_run, make_shards
from evals.base import Evaluator
from launch.config import TrainConfig, load_yaml
from model import GPT, PRESETS, GPTConfig
from runtime.gpus import GPU_MODELS, MEASUREMENTS

GPT2_124M = REPO / "configs" / "gpt2_124m.yaml"


def config(**keys) -> TrainConfig:
    return TrainConfig(**{**load_yaml(GPT2_124M), **keys})


# --- the model's arithmetic ------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [*PRESETS.values(), dict(n_layer=3, n_head=4, n_embd=96, vocab_size=512,
                                                            block_size=64, bias=False)], ids=[*PRESETS, "custom"])
def test_the_parameter_count_and_flops_are_the_real_models(shape):
    """The shape's arithmetic against model.py's GPT built on the meta device: every parameter, N without the
    position table, and the FLOPs a token the trainer's MFU divides by."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**shape))
    c = model.config
    assert est.parameter_count(c.n_layer, c.n_embd, c.vocab_size, c.block_size, c.bias) == model.num_params()
    if c.bias:
        figures = est.Shape("x", c.n_layer, c.n_head, c.n_embd, c.vocab_size, c.block_size, seq_len=c.block_size)
        assert figures.non_embedding_params == model.num_params(non_embedding=True)
        assert figures.flops_per_token() == model.estimate_flops_per_token(c.block_size)


def test_the_124m_figures_derived_by_hand():
    """GPT-2 124M: V C + T_max C + L (12 C^2 + 13 C) + 2 C parameters; 6 N + 12 L H Q T FLOPs a token."""
    shape = est.model_shape(config())
    V, C, L, H, Q, T = 50304, 768, 12, 12, 64, 1024
    assert shape.params == V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C == 124_475_904
    assert shape.non_embedding_params == 124_475_904 - T * C == 123_689_472
    assert shape.flops_per_token() == 6 * 123_689_472 + 12 * L * H * Q * T == 855_383_040


# --- the 124M run on 8 H100s -----------------------------------------------------------------------------------

def test_the_124m_run_on_8_h100s_by_hand():
    """Each figure of the estimate against its formula worked out here: time at 40% of 8 x 989.4 TFLOP/s (nothing
    was measured on an H100), evaluations at a third of the FLOPs a token, checkpoints of 12 bytes a parameter."""
    cfg = config()
    gpu = est.find_gpu("H100", "--gpu")
    hardware = est.gpu_hardware(cfg, gpu, 8)
    e = est.estimate(cfg, hardware, price=2.5)
    rate = 989.4e12 * 8 * 0.4
    tokens = 19_073 * 524_288
    assert hardware.flops_per_sec == rate and hardware.measurement is None
    assert e.tokens == tokens == 9_999_745_024 and e.train_flops == 855_383_040 * tokens
    assert e.train_s == pytest.approx(855_383_040 * tokens / rate)  # 2,702 s: 45 minutes
    # val at steps 0, 250, ..., 19,000 and 19,073: 78 passes of 10,485,760 tokens, a forward a third of a step's
    assert e.val_s == pytest.approx(78 * 10_485_760 * 855_383_040 / 3 / rate)
    row = 6 * 123_689_472 + 12 * 12 * 12 * 64 * 96  # HellaSwag's rows, 96 tokens of context
    assert e.hellaswag_s == pytest.approx(78 * 10_042 * 4 * 96 * row / 3 / rate)
    # the file format under ddp: 4 bytes of weights and 8 of AdamW's moments a parameter (docs: 1.49 GB)
    assert e.checkpoint_bytes == 12 * 124_475_904 == 1_493_710_848
    assert e.checkpoint_s == pytest.approx(4 * 1_493_710_848 / 0.37e9)  # saves at 5,000, 10,000, 15,000, 19,073
    assert e.checkpoints_on_disk == 4  # keep_last 3, and the fourth while it is written
    assert e.shard_bytes == 2 * tokens
    # ddp: 16 bytes a parameter; 64 sequences of the plain loss's activations (compile: no fused loss), a block
    # 36 C + 16 + 4 H bytes a token, outside them 6 C + 16 and the logits' 4 V; the bf16 copies of the weights
    per_sequence = 1024 * (6 * 768 + 16 + 4 * 50304 + 12 * (36 * 768 + 16 + 4 * 12))
    assert per_sequence / 2**30 == pytest.approx(0.51, abs=0.005)  # docs/PERFORMANCE.md's measured plain-loss row
    fixed = 24 * 768**2 * 12 + 2 * 50304 * 768
    assert e.memory_bytes == 16 * 124_475_904 + 64 * per_sequence + fixed
    assert e.startup_s == 34.1  # measured on an H200 for this configuration: assumed the same
    assert e.total_s == pytest.approx(e.train_s + e.val_s + e.hellaswag_s + e.checkpoint_s + 34.1)
    assert e.dollars == pytest.approx(e.total_s / 3600 * 8 * 2.5)
    assert 0.7 < e.total_s / 3600 < 0.9 and 14 < e.dollars < 18


def test_the_measured_mfu_applies_to_its_own_configuration_alone():
    """On an H200 the 124M config is the measured one: its MFU (44.1%) and start-up are used, labelled measured;
    another micro-batch there falls back to the assumed 40%, naming what differs."""
    (m,) = [m for m in MEASUREMENTS if m.gpu == "H200"]
    h200 = est.find_gpu("NVIDIA H200", "--gpu")
    hardware = est.gpu_hardware(config(), h200, 8)
    assert hardware.measurement is m
    assert hardware.flops_per_sec == pytest.approx(509_852 * 855_383_040 * 8)  # 8 GPUs at the one GPU's tokens/s
    assert "measured (2026-11-28, one H200): MFU 44.1%" in hardware.source
    other = est.gpu_hardware(config(micro_batch_size=32), h200, 8)
    assert other.measurement is None and other.flops_per_sec == 989.4e12 * 8 * 0.4
    assert "assumed: MFU 40%" in other.source and "with micro_batch_size 64, which this run does not have" in \
        other.source
    assert est.gpu_hardware(config(), h200, 8, mfu=0.5).source.startswith("given: MFU 50.0% (--mfu)")


def test_a_real_checkpoint_has_the_estimated_size(tmp_path):
    """A checkpoint written by the trainer's own checkpointer, after one AdamW step: sharded (the tied table twice,
    1.3% of it here), and a file under ddp (once) with an EMA: its bytes on disk within 0.5% of the estimate's (a
    sharded checkpoint's index and the headers of its ~100 tensors are 0.3% of this model, and a thousandth of
    gpt2's). A file without an EMA: the 124M figures above, 1.49 GB as measured (docs/PERFORMANCE.md)."""
    data = make_shards(tmp_path / "shards")
    for layout, ema in (("sharded", 0.0), ("file", 0.9)):
        out = tmp_path / f"{layout}_{ema}"
        cfg, ctx, run = build_tiny_run(data, out, checkpoint_format=layout, n_embd=512, ema_decay=ema)
        tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
        run.model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())[1].backward()
        run.optimizer.step()
        if run.ema is not None:
            run.ema.update(run.model, 0)
        run.step = 1
        from launch.components import make_checkpointer

        make_checkpointer(cfg, ctx, run, record={}).save(run, blocking=True)
        written = sum(p.stat().st_size for p in (out / "checkpoints").rglob("*") if p.is_file())
        expected = est.checkpoint_bytes(cfg, est.model_shape(cfg))
        assert written == pytest.approx(expected, rel=0.005), (layout, ema, written, expected)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("every", [0, 2, 1])
def test_the_activation_arithmetic_is_what_a_small_model_saves(fused, every):
    """benchmarks/activations.py's measurement (the bytes autograd saves in a bf16-autocast forward, at B = 1 and 2,
    on 1- and 2-layer models) of a small shape, against the estimate's arithmetic: to the byte a sequence; and what
    does not grow with B, measured on the whole model, but the few kilobytes the loss keeps beside its weights."""
    from benchmarks.activations import activation_costs, saved_bytes

    shape = est.Shape("custom", 3, 2, 64, 512, 64, seq_len=64)
    chunk = 32 if fused else 0
    measured = activation_costs(dict(n_head=2, n_embd=64, vocab_size=512, block_size=64), 64, chunk)
    assert est.scaled_activation_costs(shape, fused, every).per_sequence(3, every) == measured.per_sequence(3, every)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=64, vocab_size=512, block_size=64))
    model.recompute_blocks(every)
    one, two = (saved_bytes(model, batch, 64, chunk) for batch in (1, 2))
    kept = 3 - (0 if every == 0 else math.ceil(3 / every))  # blocks 0, every, ... are recomputed
    assert 0 <= (2 * one - two) - est.fixed_bytes(64, 512, kept, fused) <= 8200


def test_evaluations_and_checkpoints_are_counted_on_the_steps_the_trainer_runs_them():
    """The counts against the trainer's own rules, step by step: evaluations (all of them, and those past an EMA's
    start) and checkpoint saves, with and without the final one."""
    for max_steps, interval in ((10, 3), (9, 3), (5, 0), (7, 10), (1, 1)):
        evaluator = Evaluator(interval)
        due = [s for s in range(max_steps + 1) if evaluator.due(s, s == max_steps)]
        for after in (-1, 0, 2, 3, max_steps):
            assert est.eval_count(max_steps, interval, after) == len([s for s in due if s > after])
        for final in (True, False):
            saves = [s for s in range(1, max_steps + 1) if (final and s == max_steps) or (interval and s % interval == 0)]
            assert est.checkpoint_count(max_steps, interval, final) == len(saves)
    assert est.eval_count(10**300, 250) == 4 * 10**297 + 1  # a dry run's budget past any list


def test_what_the_estimate_takes_from_other_modules_is_theirs():
    """The copies a torch-free module cannot import: HellaSwag's example count, and data_dir's folders."""
    from data.mixture import parse_sources
    from evals.hellaswag import VAL_EXAMPLES

    assert est.HELLASWAG_EXAMPLES == VAL_EXAMPLES
    for data_dir in ("data/edu_fineweb10B", "a/b:0.7,c/d:0.3", "x:1"):
        assert est.source_folders(data_dir) == [s.path for s in parse_sources(data_dir)]


def test_the_strategies_that_shard_the_state_are_those_whose_forwards_gather():
    from training.distributed.strategies import STRATEGIES

    assert est.SHARDS_STATE == {name: cls.forwards_are_collective for name, cls in STRATEGIES.items()}


def test_memory_table_keeps_its_arithmetic():
    """scripts/memory_table.py's model state (now the estimate's): 16 bytes a parameter under ddp, 12/N + 4 under
    fsdp; and a micro-batch auto is the largest that fits and divides each rank's rows."""
    assert est.STATE_BYTES["ddp"](1000, 8) == 16_000 and est.STATE_BYTES["fsdp"](1000, 8) == 12_000 / 8 + 4_000
    assert est.auto_micro_batch(config(), fits=100, gpus=8) == 64  # 512 rows a step, 64 a rank
    assert est.auto_micro_batch(config(), fits=50, gpus=8) == 32


def test_memory_table_prints_the_model_state_per_gpu_and_refuses_an_unknown_preset(capfd):
    """`scripts/memory_table.py --state`: a row per preset and strategy, 16 bytes a parameter on every GPU under ddp,
    less on more GPUs under fsdp; a preset it does not know is one error line, exit 2."""
    from scripts import memory_table

    assert run_cli(memory_table.main, ["--state"]) == 0
    rows = [line.split(" | ") for line in capfd.readouterr().out.splitlines()[2:]]
    assert [(r[0], r[2]) for r in rows] == [(f"| {m}", s) for m in PRESETS for s in est.STATE_BYTES]
    ddp = next(r for r in rows if r[0] == "| gpt2" and r[2] == "ddp")
    fsdp = next(r for r in rows if r[0] == "| gpt2" and r[2] == "fsdp")
    assert ddp[1] == "124M" and ddp[3:] == ["1.9 GiB"] * 3 + ["1.9 GiB |"]
    assert fsdp[3] == "1.9 GiB" and fsdp[-1] == "0.6 GiB |"  # 12/8 + 4 bytes a parameter on 8 GPUs
    assert run_cli(memory_table.main, ["--models", "gpt9"]) == 2
    (line,) = capfd.readouterr().err.splitlines()
    assert line.startswith("error: scripts/memory_table.py: argument --models: invalid choice: 'gpt9'")


def test_the_estimate_needs_no_torch():
    """launch/estimate.py and every project module it imports (at any depth, in functions too) import no torch."""
    seen, todo = set(), ["launch.estimate"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = REPO / (name.replace(".", "/") + ".py")
        if not path.exists():
            path = REPO / name.replace(".", "/") / "__init__.py"
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and
                       getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in typing_only:  # for annotations alone: not imported when the code runs
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            for imported in names:
                assert imported.split(".")[0] != "torch", f"{name} imports {imported}"
                parts = imported.split(".")
                for depth in range(1, len(parts) + 1):  # a package's __init__ runs too
                    module = ".".join(parts[:depth])
                    if (REPO / (module.replace(".", "/") + ".py")).exists() or \
                            (REPO / module.replace(".", "/") / "__init__.py").exists():
                        todo.append(module)
    assert {"launch.estimate", "model_size", "runtime.gpus", "common.errors"} <= seen


# --- the command ----------------------------------------------------------------------------------------------

def test_the_124m_estimate_on_8_h100s_prints_each_figure_with_its_source(capsys):
    """Hours, dollars, evaluation time, disk and memory, each on its line with where it comes from under it."""
    argv = ["--config", str(GPT2_124M), "--estimate", "--gpu", "H100", "--gpus", "8", "--price", "2.5"]
    assert run_cli(train_gpt2.main, argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"Estimate of `train_gpt2.py --config {GPT2_124M}` on 8 x H100: nothing is trained")
    kinds = ("config", "derived", "measured (", "assumed", "given")
    for label, value in [("hours", r"\d\d\.\d min \(0\.\d\d h\) on 8 x H100: \d\.\d device-hours"),
                         ("dollars", r"\$1\d\.\d\d at \$2\.50 per GPU-hour"),
                         ("evaluations", r"\d+ s of the hours \(val and HellaSwag\)"),
                         ("val", r"\d+ s: 78 passes x 1 val set of 10,485,760 tokens"),
                         ("HellaSwag", r"\d+ s: 78 passes x 10,042 examples"),
                         ("disk, data", r"20\.0 GB of shards for the 9,999,745,024 tokens read"),
                         ("disk, checkpoints", r"5\.97 GB: 4 x 1\.49 GB"),
                         ("memory per GPU", r"\d+\.\d GiB = 1\.9 GiB of model state \(ddp, adamw\) \+ 64 sequences"),
                         ("start-up", r"34 s")]:
        (index,) = [i for i, line in enumerate(lines) if line.startswith(label + "  ")]
        assert re.search(value, lines[index]), lines[index]
        assert lines[index + 1].strip().startswith(kinds), lines[index + 1]
    assert "fits in 85% of the H100's 80 GiB" in out
    assert "41.2 GiB measured for this configuration" in out and "measured (2026-11-28, one H200): the peak" in out
    assert not any(line.endswith(" ") for line in lines)


@pytest.mark.parametrize("argv, message", [
    ([], "--gpu: name the GPU model to estimate for"),
    (["--gpu", "Z80"], "--gpu: 'Z80' is not in the peak FLOP/s table"),
    (["--gpu", ""], "--gpu: '' is not in the peak FLOP/s table"),
    (["--gpu"], "--gpu: missing value"),
    (["--gpu", "--gpus", "8"], "--gpu: missing value"),
    (["--gpu", "H100", "--gpu", "A100"], "--gpu: given twice"),
    (["--gpu", "H100", "--gpus", "0"], "--gpus: must be at least 1, got 0"),
    (["--gpu", "H100", "--gpus", "two"], "--gpus: expected a whole number, got 'two'"),
    (["--gpu", "H100", "--price", "-1"], "--price: must be above 0, got -1"),
    (["--gpu", "H100", "--price", "nan"], "--price: must be above 0, got nan"),
    (["--gpu", "H100", "--mfu", "1.5"], "--mfu: must be above 0 and at most 1, got 1.5"),
    (["--estimate=yes", "--gpu", "H100"], "--estimate: takes no value, got 'yes'"),
    (["--gpu", "H100", "--max_steps", "0"], "max_steps: must be"),
    (["--gpu", "H100", "--gpus", "3"], "total_batch_size:"),  # 512 rows a step do not split over 3 GPUs of 64
])
def test_a_bad_flag_is_one_error_line(argv, message, capfd):
    assert run_cli(train_gpt2.main, ["--config", str(GPT2_124M), "--estimate", *argv]) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_the_estimates_flags_are_no_config_keys_and_help_lists_them(capsys):
    assert not {est.ESTIMATE, *est.VALUED} & set(TrainConfig.keys())
    assert train_gpt2.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n  --{flag}" in out for flag in (est.ESTIMATE, *est.VALUED))
    assert all(est.find_gpu(gpu.name, "--gpu") is gpu for gpu in GPU_MODELS)  # every name finds its own row


def test_the_data_folders_manifest_gives_the_tokens_it_holds(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "local_manifest.json").write_text('{"format": 1, "shards": [{"tokens": 300}, {"tokens": 700}]}')
    assert est.prepared_tokens(str(tmp_path / "a")) == 1000
    assert est.prepared_tokens(f"{tmp_path / 'a'}:1,{tmp_path / 'b'}:1") is None  # b holds no prep
    assert math.isclose(est.estimate(config(data_dir=str(tmp_path / "a")), est.gpu_hardware(
        config(), est.find_gpu("H100", "--gpu"), 8)).shard_bytes, 2 * 9_999_745_024)


def test_the_documented_estimate_is_what_the_command_prints(capsys):
    """docs/PERFORMANCE.md ("Before a run") shows the 124M estimate on 8 H100s at $2.50: the command's output today."""
    text = (REPO / "docs" / "PERFORMANCE.md").read_text()
    shown = text.split("## Before a run: the estimate", 1)[1].split("```\n", 2)[1]
    argv = ["--config", "configs/gpt2_124m.yaml", "--estimate", "--gpu", "H100", "--gpus", "8", "--price", "2.5"]
    assert run_cli(train_gpt2.main, argv) == 0
    assert capsys.readouterr().out == shown
