"""The speed settings of the runtime section (docs/PERFORMANCE.md, "Speed levers"), on the CPU: each default is the
path the trainer took before the key existed, each lever's math is today's (float32 within 1e-6, or bitwise where the
ops are the same), and a lever that cannot run here is one error line naming its key. Their GPU speed is
scripts/gpu_check.sh's `levers` part; the kernels themselves are tests/test_kernels.py's."""

from __future__ import annotations

import pytest
import torch

from common.errors import ConfigError
from conftest import base_args, build_tiny_run, load_weights, lockstep_steps, make_shards, run_trainer, train_here
from launch.config import TrainConfig
from runtime.runtime import DDPOptions

LEVERS = dict(loss_kernel="triton", fused_residual_norm=True)  # the two that run on any device (torch fallbacks)


def test_the_defaults_hand_the_model_nothing_new_and_compile_it_as_before(monkeypatch):
    runtime = TrainConfig(device="cpu").runtime.make_runtime()
    assert runtime.loss_head is None and runtime.add_norm is None and runtime.levers() == []
    assert runtime.ddp == DDPOptions() and runtime.ddp.kwargs() == {}  # DistributedDataParallel(model, device_ids)
    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: calls.append(kwargs) or model)
    runtime.compiled(torch.nn.Linear(2, 2))
    tuned = TrainConfig(device="cpu", compile_mode="max-autotune-no-cudagraphs").runtime.make_runtime()
    tuned.compiled(torch.nn.Linear(2, 2))
    assert calls == [{}, {"mode": "max-autotune-no-cudagraphs"}]


def test_each_lever_set_is_what_the_runtime_hands_on_and_the_startup_line_names():
    runtime = TrainConfig(device="cpu", compile=True, compile_mode="max-autotune-no-cudagraphs", ddp_bucket_cap_mb=50,
                          ddp_gradient_as_bucket_view=True, ddp_static_graph=True, **LEVERS).runtime.make_runtime()
    assert runtime.ddp.kwargs() == {"bucket_cap_mb": 50.0, "gradient_as_bucket_view": True, "static_graph": True}
    assert runtime.loss_head is not None and runtime.add_norm is not None and runtime.loss_chunk_size == 0
    fallback = "" if runtime.levers()[1] == "loss_kernel triton" else " (torch fallback: no Triton kernel on this device)"
    assert runtime.levers() == ["compile_mode max-autotune-no-cudagraphs", f"loss_kernel triton{fallback}",
                                f"fused_residual_norm{fallback}", "ddp bucket_cap_mb 50.0",
                                "ddp gradient_as_bucket_view True", "ddp static_graph True"]


@pytest.mark.parametrize("keys,message", [
    (dict(compile_mode="max-autotune"), "compile_mode: unknown mode 'max-autotune'; choose default or "
                                        "max-autotune-no-cudagraphs"),
    (dict(loss_kernel="liger"), "loss_kernel: unknown kernel 'liger'; choose torch or triton"),
    (dict(loss_kernel="triton", loss_chunk_size=8192), "loss_kernel: triton makes the whole logits, and "
                                                       "loss_chunk_size 8192 asks for chunks of them"),
    (dict(fp8_lm_head=True, optimizer="muon", loss_chunk_size=64), "fp8_lm_head: True makes the whole logits"),
    (dict(ddp_bucket_cap_mb=0), "ddp_bucket_cap_mb: must be positive, got 0.0"),
    (dict(ddp_static_graph="sometimes"), "ddp_static_graph: expected true/false, got 'sometimes'"),
    (dict(fused_residual_norm=2), "fused_residual_norm: expected true/false, got 2"),
    (dict(fp8_lm_head=True), "fp8_lm_head: is for the modern recipe (optimizer muon, configs/*_modern.yaml) only"),
    (dict(fp8_lm_head=True, optimizer="muon", vocab_size=50257), "fp8_lm_head: needs n_embd and vocab_size "
                                                                 "multiples of 16 (FP8 matrix products), got 768 and 50257"),
])
def test_a_bad_lever_value_is_one_error_naming_its_key(keys, message):
    with pytest.raises(ConfigError) as caught:
        TrainConfig(**keys)
    assert str(caught.value).startswith(message), caught.value


def test_the_fp8_lm_head_off_a_cuda_gpu_with_fp8_is_one_error_line_before_any_work(tmp_path, capfd):
    """The modern recipe with fp8_lm_head on this machine's CPU: exit 2, one `error:` line naming the key."""
    args = base_args(make_shards(tmp_path / "data"), tmp_path / "run", optimizer="muon", fp8_lm_head="true",
                     vocab_size=512)
    assert train_here(args) == 2
    out, err = capfd.readouterr()
    assert err == ("error: fp8_lm_head: needs a CUDA GPU with FP8 matrix units (compute capability 8.9 or newer: Ada, "
                   "Hopper, Blackwell); this run is on cpu\n"), err
    assert not (tmp_path / "run").exists()


def test_the_modern_recipe_takes_the_fp8_lm_head_and_the_faithful_one_refuses_it():
    from launch.config import parse_args

    assert parse_args(["--config", "configs/gpt2_124m_modern.yaml", "--fp8_lm_head", "true"]).runtime.fp8_lm_head
    with pytest.raises(ConfigError, match="^fp8_lm_head: is for the modern recipe"):
        parse_args(["--config", "configs/gpt2_124m.yaml", "--fp8_lm_head", "true"])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_training_steps_with_the_loss_kernel_and_the_fused_norms_match_the_default_ones(shards, tmp_path, dtype):
    """Two steps of the trainer's own step (the runtime's loss head and fused blocks, as Strategy.training_model
    sets them up) against the default path. float32: the losses within 1e-6 (the weights part further: Adam
    scales gradients that differ by rounding up to lr-sized steps). float64: the weights too, to 1e-12."""
    runs = {}
    for name, keys in (("default", {}), ("levers", LEVERS)):
        cfg, ctx, run = build_tiny_run(shards, tmp_path / name, dtype=dtype, **keys)
        assert run.strategy.training_model(run.model) is run.model  # one process, eager: the model itself
        assert all(block.add_norm is ctx.runtime.add_norm for block in run.model.transformer.h)
        runs[name] = [r.loss for r in lockstep_steps(cfg, ctx, run, 2)], {
            n: p.detach().clone() for n, p in run.model.named_parameters()}
    (losses, weights), (lever_losses, lever_weights) = runs["default"], runs["levers"]
    for got, want in zip(lever_losses, losses, strict=True):
        assert abs(got - want) <= 1e-6 * want
    if dtype == "float64":
        for name, value in lever_weights.items():
            assert torch.linalg.norm(value - weights[name]) <= 1e-12 * torch.linalg.norm(weights[name]), name


@pytest.mark.slow  # 2-rank trainer launches
def test_ddp_bucket_settings_give_the_same_weights_bit_for_bit(shards, tmp_path):
    """2 ranks on gloo against DDP's defaults, the same weights after 3 steps bit for bit: tiny buckets (many
    all-reduces, each the sum of the same two numbers) and gradients as bucket views, with each rank accumulating
    2 micro-batches; and those with a static graph, which takes one micro-batch a step only (a ConfigError
    otherwise, before any step)."""
    short = dict(max_steps=3, checkpoint_interval=3, eval_interval=0)
    buckets = dict(ddp_bucket_cap_mb=0.01, ddp_gradient_as_bucket_view="true")
    cases = {"accumulating": (dict(total_batch_size=512), buckets),  # 512 = 2 ranks x 2 micro-steps x 4 x 32
             "one_micro_step": (dict(total_batch_size=256), dict(buckets, ddp_static_graph="true"))}
    for name, (batch, levers) in cases.items():
        run_trainer(base_args(shards, tmp_path / name / "default", **short, **batch), nproc=2)
        run_trainer(base_args(shards, tmp_path / name / "levers", **short, **batch, **levers), nproc=2)
        default, tuned = load_weights(tmp_path / name / "default", 3), load_weights(tmp_path / name / "levers", 3)
        assert default.keys() == tuned.keys()
        for key in default:
            assert torch.equal(default[key], tuned[key]), (name, key)
    refused = run_trainer(base_args(shards, tmp_path / "refused", **short, ddp_static_graph="true"), nproc=2,
                          check=False)
    assert refused.returncode == 2 and refused.stderr.strip() == (
        "error: ddp_static_graph: DDP's static graph does not take gradient accumulation, and each rank accumulates "
        "2 micro-batches a step here: set ddp_static_graph false, or micro_batch_size so that grad_accum_steps is 1")
