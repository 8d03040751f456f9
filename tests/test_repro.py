"""The `deterministic` key and benchmarks/repro_check.py, the tool that says whether runs repeat bit for bit.

On the CPU the kernels repeat anyway, so these tests check the mechanism: the key puts every
training step under torch's deterministic mode and takes it off again; repro_check compares
runs, kernels and gradients correctly, and names the layer where injected nondeterminism
enters a backward or a forward. What the GPU's own kernels do is scripts/gpu_check.sh's
`repro` part.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import base_args, run_trainer, train_losses, train_here
from slowness import guard

from benchmarks import repro_check
from common.errors import run_cli
from model import GPT, GPTConfig
from runtime.runtime import deterministic_kernels  # noqa: E402


def test_the_deterministic_key_runs_every_step_in_deterministic_mode_and_changes_no_cpu_bits(shards, tmp_path,
                                                                                          monkeypatch):
    seen = []

    def watch(step):
        def watched(*args):
            seen.append((torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
                         torch.utils.deterministic.fill_uninitialized_memory))
            return step(*args)
        return watched

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert train_here(base_args(shards, tmp_path / "plain")) == 0
    assert train_here(base_args(shards, tmp_path / "det", deterministic="true"), wrap_step=watch) == 0
    assert seen == [(True, True, False)] * 6  # no NaN fill of new tensors: the trainer reads none unwritten
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic  # put back
    assert torch.utils.deterministic.fill_uninitialized_memory
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert train_losses(tmp_path / "det") == train_losses(tmp_path / "plain")  # CPU kernels were already
    # run.json says which cuBLAS workspace each run had
    kernel_env = {name: json.loads((tmp_path / name / "run.json").read_text())["kernel_env"] for name in ("plain", "det")}
    assert "CUBLAS_WORKSPACE_CONFIG" not in kernel_env["plain"]
    assert kernel_env["det"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_deterministic_kernels_puts_back_what_was_there():
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with deterministic_kernels(True):
            assert torch.are_deterministic_algorithms_enabled()
            assert not torch.is_deterministic_algorithms_warn_only_enabled()  # an op without one raises
            with pytest.raises(RuntimeError, match="deterministic"):
                torch.zeros(4).put_(torch.tensor([0, 0]), torch.ones(2))  # put_ without accumulate has none
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    with deterministic_kernels(False):
        assert not torch.are_deterministic_algorithms_enabled()


def test_compare_losses_names_the_first_differing_step_and_the_largest_gap():
    a = {0: 10.0, 1: 9.5, 2: 9.0, 3: 8.5}
    assert repro_check.compare_losses(a, dict(a)) == {"steps": 4, "equal": True, "first_differing_step": None,
                                                      "differing_steps": 0, "max_abs_diff": 0.0}
    b = {0: 10.0, 1: 9.5, 2: 9.0 + 2**-20, 3: 8.25}
    result = repro_check.compare_losses(a, b)
    assert (result["equal"], result["first_differing_step"], result["differing_steps"]) == (False, 2, 2)
    assert result["max_abs_diff"] == 0.25
    assert repro_check.compare_losses(a, {0: 10.0})["first_differing_step"] == 1  # a missing step differs


def test_repeat_compare_tells_a_repeatable_op_from_one_that_varies_and_one_that_raises():
    x = torch.randn(64, 64)
    assert repro_check.repeat_compare(lambda: {"y": x @ x}) == {"equal": True, "differing": [], "max_abs_diff": 0.0}
    noisy = repro_check.repeat_compare(lambda: {"y": x @ x, "z": x + torch.rand(()) * 1e-3})
    assert not noisy["equal"] and noisy["differing"] == ["z"] and 0 < noisy["max_abs_diff"] < 1e-3
    with deterministic_kernels(True):
        raised = repro_check.repeat_compare(lambda: {"y": torch.zeros(4).put_(torch.tensor([1]), torch.ones(1))})
    assert "deterministic" in raised["error"]


def test_every_kernel_probe_runs_and_repeats_on_the_cpu():
    shape = repro_check.SHAPES["dry"]
    probes = repro_check.kernel_probes(shape, torch.device("cpu"))
    assert set(probes) == {"matmul", "attention", "embedding", "cross_entropy", "layer_norm", "adamw"}
    for name, op in probes.items():
        assert repro_check.repeat_compare(op, repeats=2)["equal"], name


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=3, n_head=2, n_embd=32))


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def test_gradient_check_finds_nothing_in_a_repeatable_model():
    model = tiny_gpt()
    result = repro_check.gradient_check(model, model, *tokens(), torch.autocast("cpu", enabled=False), hooks=True)
    assert result["loss_equal"] and result["first_forward_difference"] is None
    assert result["gradients_differing"] == 0 and result["nearest_the_loss"] is None
    assert result["parameters"] == len(list(model.parameters()))


def test_gradient_check_names_the_layer_where_backward_noise_enters():
    """Noise on the gradient reaching block 1's attention output, as an atomics-summing attention
    backward would make: block 1's c_proj is the nearest parameter to differ, and everything nearer
    the input differs with it; block 1's MLP, block 2 and the final LayerNorm do not."""
    model = tiny_gpt()

    def noisy_backward(module, args, out):
        out.register_hook(lambda grad: grad + torch.randn_like(grad) * 1e-6)

    model.transformer.h[1].attn.register_forward_hook(noisy_backward)
    result = repro_check.gradient_check(model, model, *tokens(), torch.autocast("cpu", enabled=False), hooks=True)
    assert result["loss_equal"] and result["first_forward_difference"] is None
    assert result["nearest_the_loss"] == "transformer.h.1.attn.c_proj.bias"
    differing = set(result["differing"])
    assert {"transformer.h.1.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight"} <= differing
    assert not differing & {"transformer.h.1.mlp.c_fc.weight", "transformer.h.2.attn.c_proj.weight",
                            "transformer.ln_f.weight"}


def test_gradient_check_names_the_first_module_whose_forward_output_differs():
    model = tiny_gpt()
    model.transformer.h[0].mlp.register_forward_hook(lambda module, args, out: out + torch.rand(()) * 1e-6)
    result = repro_check.gradient_check(model, model, *tokens(), torch.autocast("cpu", enabled=False), hooks=True)
    assert not result["loss_equal"] and result["first_forward_difference"] == "transformer.h.0.mlp"


def forked_launch(args: list[str], log, cache, timeout: float) -> str | None:
    """repro_check.launch with the trainer's process forked by tests/forked_ranks.py instead of started afresh:
    the same trainer code, arguments and environment (this process's, as a subprocess inherits it),
    without the seconds of imports that each of the six launches would spend. What launch adds, the
    command line and its timeout, is the GPU check's (scripts/gpu_check.sh's repro part)."""
    proc = run_trainer(args, check=False, timeout=120, extra_env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    log.write_text(proc.stdout + proc.stderr)
    return repro_check.outcome(proc.returncode, log)


@pytest.mark.slow
def test_a_launch_that_fails_is_its_exit_code_and_error_line(tmp_path):
    """launch's own process (the dry run's are forked): a trainer that refuses its arguments."""
    log = tmp_path / "a.log"
    error = repro_check.launch(["--max_steps", "0"], log, tmp_path / "inductor", timeout=guard(120))
    assert error == "exit 2: error: max_steps: must be positive, got 0", log.read_text()
    log.write_text("Segmentation fault\n")
    assert repro_check.outcome(-11, log) == "exit -11: Segmentation fault"  # no error line: the log's last


@pytest.mark.slow
def test_repro_check_dry_run_finds_deterministic_cpu_runs_and_resumes_bitwise(tmp_path, monkeypatch):
    """The script's runs stage on the CPU: three launches of the trainer in each mode (forked_launch).

    The default mode's launches run as the user's would: without the fixed cuBLAS workspace that
    the deterministic mode sets (and the script's own in-process stages need later)."""
    from conftest import make_shards

    data = make_shards(tmp_path / "data")
    monkeypatch.setattr(repro_check, "launch", forked_launch)
    saved = os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    try:
        assert run_cli(repro_check.main, ["--data_dir", str(data), "--out", str(tmp_path / "out"), "--dry_run",
                                          "--steps", "4", "--stages", "runs"]) == 0
    finally:  # main sets it for its in-process stages
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        if saved is not None:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved
    report = json.loads((tmp_path / "out" / "repro.json").read_text())
    assert [run["mode"] for run in report["runs"]] == ["default", "deterministic"]
    for run in report["runs"]:
        assert not run["errors"]
        assert run["a_vs_b"]["losses"]["equal"] and run["a_vs_b"]["weights"]["equal"]
        assert run["a_vs_resumed"]["losses"] == {"steps": 2, "equal": True, "first_differing_step": None,
                                                 "differing_steps": 0, "max_abs_diff": 0.0}
        assert run["a_vs_resumed"]["weights"]["equal"] and set(run["ms_per_step"]) == {"a", "b"}
        for name in ("a", "b", "resumed"):
            kernel_env = json.loads((tmp_path / "out" / run["mode"] / name / "run.json").read_text())["kernel_env"]
            workspace = kernel_env.get("CUBLAS_WORKSPACE_CONFIG")
            assert workspace == (":4096:8" if run["mode"] == "deterministic" else None), (run["mode"], name)
    summary = (tmp_path / "out" / "repro.md").read_text()
    assert "| default | bitwise | bitwise |" in summary and "| deterministic | bitwise | bitwise |" in summary
    assert "deterministic: true" in (tmp_path / "out" / "deterministic" / "a" / "config.yaml").read_text()
