"""Do two identical runs give the same bits, and a resume the same losses? Which kernels differ, and
what the `deterministic` key costs.

    python benchmarks/repro_check.py --data_dir DIR --out OUT           # GPT-2 124M on one GPU, compiled
    python benchmarks/repro_check.py --data_dir DIR --out OUT --dry_run # the same plumbing on the CPU, tiny model
    python benchmarks/repro_check.py --data_dir DIR --out OUT --modes default --stages runs

Three stages, all written to OUT/repro.json and summed up in OUT/repro.md:

1. runs: for each mode (default, then `--deterministic true`), two straight runs of --steps steps,
   each in its own process, and a third that resumes the second one's half-way checkpoint in a
   new folder. Their per-step losses and final weights are compared bit for bit (the first step
   that differs, the largest difference), and the mode's median ms/step after the first ten steps
   is its cost. The launches share one inductor cache (OUT/inductor), as a user's second run on a
   machine does; --fresh_cache gives each its own, as on a fresh machine.
2. kernels: each kind of op in a training step (cuBLAS matmul, SDPA attention, the embedding's
   backward, cross-entropy, LayerNorm, fused AdamW) runs three times on the same inputs at the
   model's shapes and the results are compared bit for bit, in each mode. An op that raises
   under torch's deterministic mode is recorded with its message.
3. gradients: one micro-batch's forward and backward twice from the same weights and tokens,
   eager, in each mode, and compiled too where that mode's two straight runs differed (a compile
   costs a minute): whether the loss matches, the first module whose forward output differs
   (eager: module hooks), and the parameters whose gradients differ, nearest the loss first. The
   first parameter in that order is where nondeterminism enters the backward; every parameter
   nearer the input then differs with it.

scripts/gpu_check.sh runs it as its `repro` part, on the repository-text corpus.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from common.errors import ArgumentParser, ConfigError, run_cli  # noqa: E402
from runtime.runtime import deterministic_kernels  # noqa: E402

MODES = {"default": [], "deterministic": ["--deterministic", "true"]}
WARM_STEPS = 10  # ms/step is the median over the steps after these (the first ones compile and warm up)
SHAPES = {  # B, T, n_layer, n_head, n_embd, vocab, and the trainer's arguments for the runs
    "gpu": dict(B=16, T=1024, n_layer=12, n_head=12, n_embd=768, vocab=50304, device="cuda", dtype="bfloat16",
                compile=True, args=["--model", "gpt2", "--block_size", "1024", "--seq_len", "1024",
                                    "--micro_batch_size", "16", "--total_batch_size", "32768", "--max_lr", "6e-4",
                                    "--device", "cuda", "--dtype", "bfloat16", "--compile", "true"]),
    "dry": dict(B=4, T=32, n_layer=2, n_head=2, n_embd=64, vocab=50304, device="cpu", dtype="float32",
                compile=False, args=["--model", "custom", "--n_layer", "2", "--n_head", "2", "--n_embd", "64",
                                     "--block_size", "32", "--seq_len", "32", "--micro_batch_size", "4",
                                     "--total_batch_size", "256", "--max_lr", "3e-3", "--device", "cpu",
                                     "--dtype", "float32", "--compile", "false"]),
}


# --- 1. runs ------------------------------------------------------------------------------------
def compare_losses(a: dict[int, float], b: dict[int, float]) -> dict:
    """Two runs' per-step losses: bitwise equal, or the first step that differs and the largest gap."""
    steps = sorted(set(a) | set(b))
    differing = [s for s in steps if a.get(s) != b.get(s)]
    gaps = [abs(a[s] - b[s]) for s in differing if s in a and s in b]
    return {"steps": len(steps), "equal": not differing, "first_differing_step": differing[0] if differing else None,
            "differing_steps": len(differing), "max_abs_diff": max(gaps, default=0.0)}


def compare_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    differing = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
    return {"equal": not differing and set(a) == set(b), "tensors": len(a), "differing": differing[:10],
            "differing_count": len(differing)}


def train_losses(run: Path) -> dict[int, float]:
    from runtime.logger import read_log

    return {r["step"]: r["loss"] for r in read_log(run / "log.jsonl") if r["kind"] == "train"}


def steady_ms(run: Path, warm_steps: int) -> float | None:
    from runtime.logger import read_log

    ms = [r["step_ms"] for r in read_log(run / "log.jsonl") if r["kind"] == "train" and r["step"] >= warm_steps]
    return statistics.median(ms) if ms else None


def final_weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    from training.checkpoint.folder import list_checkpoints, read_full_state

    (path,) = [p for s, p in list_checkpoints(run / "checkpoints") if s == step]
    return read_full_state(path)["model"]


def launch(args: list[str], log: Path, cache: Path, timeout: float) -> str | None:
    """train_gpt2.py in its own process; None when it finished, else why not (one line)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
    with open(log, "w") as out:
        try:
            proc = subprocess.run([sys.executable, str(REPO / "train_gpt2.py"), *args], cwd=REPO, env=env,
                                  stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:.0f} s"
    return outcome(proc.returncode, log)


def outcome(returncode: int, log: Path) -> str | None:
    """None for a run that finished, else its exit code and error line (or its log's last line)."""
    if returncode == 0:
        return None
    lines = log.read_text(errors="replace").splitlines()
    return f"exit {returncode}: " + next((x for x in reversed(lines) if x.startswith("error:")),
                                              lines[-1] if lines else "no output")


def run_mode(mode: str, base: list[str], steps: int, out: Path, fresh_cache: bool, timeout: float) -> dict:
    """Straight runs a and b, and b's half-way checkpoint resumed in a new folder."""
    half = steps // 2
    folder = out / mode
    shutil.rmtree(folder, ignore_errors=True)  # an earlier check's runs would be resumed, not repeated
    folder.mkdir(parents=True)
    args = [*base, *MODES[mode], "--max_steps", str(steps), "--checkpoint_interval", str(half)]
    halfway = folder / "b" / "checkpoints" / f"step_{half:08d}.pt"
    plan = {"a": args, "b": args, "resumed": [*args, "--resume", str(halfway)]}
    result: dict = {"mode": mode, "steps": steps, "resumed_at": half, "errors": {}}
    for name, run_args in plan.items():
        cache = out / "inductor" / (f"{mode}-{name}" if fresh_cache else "shared")
        start = time.time()
        error = launch([*run_args, "--out_dir", str(folder / name)], folder / f"{name}.log", cache, timeout)
        print(f"  {mode} {name}: {error or 'done'} ({time.time() - start:.0f} s)", flush=True)
        if error:
            result["errors"][name] = error
    finished = [name for name in plan if name not in result["errors"]]
    losses = {name: train_losses(folder / name) for name in finished}
    weights = {name: final_weights(folder / name, steps) for name in finished}
    warm = min(WARM_STEPS, half)
    result["ms_per_step"] = {name: steady_ms(folder / name, warm) for name in finished if name != "resumed"}
    for other, name in (("b", "a_vs_b"), ("resumed", "a_vs_resumed")):
        if "a" in losses and other in losses:  # the resumed run logs the steps from half on: those compare
            a_losses = {s: v for s, v in losses["a"].items() if s >= half} if other == "resumed" else losses["a"]
            result[name] = {"losses": compare_losses(a_losses, losses[other]),
                            "weights": compare_weights(weights["a"], weights[other])}
    result["losses"] = losses
    return result


# --- 2. kernels ---------------------------------------------------------------------------------
def repeat_compare(op: Callable[[], dict[str, torch.Tensor]], repeats: int = 3) -> dict:
    """op() `repeats` times (it builds its own seeded inputs); every result against the first, bit for bit."""
    try:
        first = op()
        differing, gap = set(), 0.0
        for _ in range(repeats - 1):
            again = op()
            for key, value in first.items():
                if not torch.equal(value, again[key]):
                    differing.add(key)
                    gap = max(gap, (value.double() - again[key].double()).abs().max().item())
    except RuntimeError as e:  # deterministic mode: an op with only a nondeterministic kernel
        return {"error": str(e).strip().splitlines()[0][:300]}
    return {"equal": not differing, "differing": sorted(differing), "max_abs_diff": gap}


def kernel_probes(shape: dict, device: torch.device) -> dict[str, Callable[[], dict[str, torch.Tensor]]]:
    """The step's kinds of op at the model's shapes, each a function of fresh, seeded inputs."""
    B, T, C, H, V = shape["B"], shape["T"], shape["n_embd"], shape["n_head"], shape["vocab"]
    half = torch.bfloat16 if shape["dtype"] == "bfloat16" else torch.float32

    def rand(*size, dtype=torch.float32, seed=0, grad=True):
        g = torch.Generator(device=device).manual_seed(seed)
        return torch.randn(*size, generator=g, device=device, dtype=torch.float32).to(dtype).requires_grad_(grad)

    def tokens(seed=5):
        g = torch.Generator(device=device).manual_seed(seed)
        return torch.randint(0, V, (B * T,), generator=g, device=device)

    def matmul():  # an MLP's c_fc: (B*T, C) @ (C, 4C), as autocast runs it
        x, w = rand(B * T, C, dtype=half, seed=1), rand(4 * C, C, dtype=half, seed=2)
        y = x @ w.t()
        y.backward(rand(B * T, 4 * C, dtype=half, seed=3, grad=False))
        return {"out": y.detach(), "grad_x": x.grad, "grad_w": w.grad}

    def attention():  # causal SDPA (flash on an H100 in bf16)
        q, k, v = (rand(B, H, T, C // H, dtype=half, seed=s) for s in (1, 2, 3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y.backward(rand(B, H, T, C // H, dtype=half, seed=4, grad=False))
        return {"out": y.detach(), "grad_q": q.grad, "grad_k": k.grad, "grad_v": v.grad}

    def embedding():  # wte's backward: B*T rows summed into V rows (repeated tokens collide)
        w = rand(V, C, seed=1)
        y = F.embedding(tokens(), w)
        y.backward(rand(B * T, C, seed=2, grad=False))
        return {"grad_w": w.grad}

    def cross_entropy():  # the plain loss on fp32 logits
        logits = rand(B * T, V, seed=1)
        loss = F.cross_entropy(logits, tokens())
        loss.backward()
        return {"loss": loss.detach(), "grad_logits": logits.grad}

    def layer_norm():  # autocast runs it in fp32; its weight and bias gradients sum over B*T rows
        x, w, b = rand(B * T, C, seed=1), rand(C, seed=2), rand(C, seed=3)
        y = F.layer_norm(x, (C,), w, b)
        y.backward(rand(B * T, C, seed=4, grad=False))
        return {"out": y.detach(), "grad_x": x.grad, "grad_w": w.grad, "grad_b": b.grad}

    def adamw():  # two fused AdamW steps on a block's worth of parameters
        params = [rand(4 * C, C, seed=1), rand(C, seed=2)]
        opt = torch.optim.AdamW(params, lr=6e-4, weight_decay=0.1, fused=device.type == "cuda")
        for step in range(2):
            for i, p in enumerate(params):
                p.grad = rand(*p.shape, seed=10 + 2 * step + i, grad=False)
            opt.step()
        return {f"param_{i}": p.detach() for i, p in enumerate(params)}

    return {"matmul": matmul, "attention": attention, "embedding": embedding, "cross_entropy": cross_entropy,
            "layer_norm": layer_norm, "adamw": adamw}


# --- 3. gradients -------------------------------------------------------------------------------
def gradient_check(model: torch.nn.Module, forward: Callable, x: torch.Tensor, y: torch.Tensor,
                   autocast, hooks: bool) -> dict:
    """forward(x, y) -> (logits, loss) and its backward twice from the same weights: what differs.

    hooks: record every module's forward output (eager only: compiled graphs skip module hooks).
    """
    outputs, names = [], {m: n for n, m in model.named_modules() if n}

    def capture(record: list):
        def hook(module, args, out):
            if isinstance(out, torch.Tensor):
                record.append((names[module], out.detach().clone()))
        return hook

    for _ in range(2):
        model.zero_grad(set_to_none=True)
        record: list = []
        handles = [m.register_forward_hook(capture(record)) for m in names] if hooks else []
        try:
            with autocast:
                _, loss = forward(x, y)
            loss.backward()
        finally:
            for handle in handles:
                handle.remove()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        outputs.append((loss.detach().clone(), record, grads))
    (loss_a, record_a, grads_a), (loss_b, record_b, grads_b) = outputs
    first_forward = next((name for (name, a), (_, b) in zip(record_a, record_b) if not torch.equal(a, b)), None)
    backward_order = [n for n, _ in reversed(list(model.named_parameters()))]  # nearest the loss first
    differing = [n for n in backward_order if n in grads_a and not torch.equal(grads_a[n], grads_b[n])]
    return {"loss_equal": torch.equal(loss_a, loss_b), "loss_abs_diff": (loss_a - loss_b).abs().item(),
            "first_forward_difference": first_forward if hooks else "not recorded (compiled)",
            "gradients_differing": len(differing), "parameters": len(grads_a),
            "nearest_the_loss": differing[0] if differing else None, "differing": differing[:12]}


def gradient_checks(shape: dict, device: torch.device, compiled_too: bool, seed: int = 1337) -> list[dict]:
    """gradient_check on the model at its shapes, eager, then compiled where asked (and configured)."""
    from model import GPT, GPTConfig
    from runtime.runtime import resolve_runtime

    runtime = resolve_runtime(str(device), shape["dtype"], shape["compile"], 0)
    g = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.randint(0, shape["vocab"], (shape["B"], shape["T"] + 1), generator=g, device=device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # (B, T) each
    results = []
    for compiled in ([False, True] if shape["compile"] and compiled_too else [False]):
        torch.manual_seed(seed)
        model = GPT(GPTConfig(block_size=shape["T"], vocab_size=shape["vocab"], n_layer=shape["n_layer"],
                              n_head=shape["n_head"], n_embd=shape["n_embd"])).to(device)
        forward = torch.compile(model) if compiled else model
        result = gradient_check(model, forward, x, y, runtime.autocast(), hooks=not compiled)
        results.append({"compiled": compiled, **result})
        del model, forward
    return results


# --- the report ---------------------------------------------------------------------------------
def verdict(comparison: dict | None) -> str:
    if comparison is None:
        return "-"
    losses, weights = comparison["losses"], comparison["weights"]
    if losses["equal"] and weights["equal"]:
        return "bitwise"
    if losses["equal"]:
        return f"losses bitwise, {weights['differing_count']} weight tensors differ"
    return (f"differ from step {losses['first_differing_step']} (max {losses['max_abs_diff']:.3g}), "
            f"{weights['differing_count']} weight tensors differ")


def markdown(report: dict) -> str:
    md = [f"## Reproducibility (benchmarks/repro_check.py): {report['model']}, {report['steps']} steps, "
          f"{report['device']}", ""]
    if runs := report.get("runs", []):
        default_ms = next((statistics.mean(r["ms_per_step"].values()) for r in runs
                           if r["mode"] == "default" and r["ms_per_step"]), None)
        md += ["| mode | two straight runs | straight vs resumed | ms/step | cost | errors |",
               "| --- | --- | --- | --- | --- | --- |"]
        for r in runs:
            ms = statistics.mean(r["ms_per_step"].values()) if r["ms_per_step"] else None
            cost = f"{ms / default_ms:.3f}x" if ms and default_ms else "-"
            md.append(f"| {r['mode']} | {verdict(r.get('a_vs_b'))} | {verdict(r.get('a_vs_resumed'))} "
                      f"| {'-' if ms is None else f'{ms:.1f}'} | {cost} "
                      f"| {'; '.join(f'{k}: {v}' for k, v in r['errors'].items()) or '-'} |")
        md.append("")

    def outcome(probe: dict) -> str:
        if "error" in probe:
            return f"error: {probe['error']}"
        differing = "/".join(probe["differing"])
        return "bitwise" if probe["equal"] else f"DIFFER {differing} (max {probe['max_abs_diff']:.3g})"

    for mode, probes in report.get("kernels", {}).items():
        md += [f"Kernels run three times on the same inputs ({mode}): "
               + ", ".join(f"{name} {outcome(p)}" for name, p in probes.items()), ""]
    for mode, checks in report.get("gradients", {}).items():
        for c in checks:
            md.append(f"Gradients twice ({mode}, {'compiled' if c['compiled'] else 'eager'}): loss "
                      f"{'bitwise' if c['loss_equal'] else 'differs'}, first forward difference "
                      f"{c['first_forward_difference']}, {c['gradients_differing']}/{c['parameters']} gradients "
                      f"differ, nearest the loss: {c['nearest_the_loss']}")
        md.append("")
    return "\n".join(md).rstrip() + "\n"


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="repro_check.py", description=__doc__)
    parser.add_argument("--data_dir", required=True, help="token shards the runs train on")
    parser.add_argument("--out", required=True, help="folder for the runs, repro.json and repro.md")
    parser.add_argument("--steps", type=int, default=50, help="steps of each straight run (the resume starts at half)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--stages", nargs="+", default=["runs", "kernels", "gradients"],
                        choices=["runs", "kernels", "gradients"])
    parser.add_argument("--dry_run", action="store_true", help="the tiny model on the CPU (plumbing only)")
    parser.add_argument("--fresh_cache", action="store_true", help="each launch compiles into its own empty cache")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one launch may take")
    args = parser.parse_args(argv)
    if args.steps < 2:
        raise ConfigError("--steps must be at least 2 (the resume starts at half)")
    shape = SHAPES["dry" if args.dry_run else "gpu"]
    device = torch.device(shape["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("CUDA is not available: use --dry_run to rehearse on the CPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = [*shape["args"], "--data_dir", args.data_dir, "--warmup_steps", str(min(10, args.steps // 2)),
            "--eval_interval", "0", "--val_tokens", str(shape["B"] * shape["T"]), "--hellaswag_interval", "0",
            "--sample_interval", "0", "--keep_last", "5", "--wandb", "false", "--seed", "1337",
            "--log_interval", "10"]
    report = {"model": "gpt2" if not args.dry_run else "tiny", "steps": args.steps, "device": shape["device"],
              "dtype": shape["dtype"], "compile": shape["compile"], "torch": torch.__version__,
              "fresh_cache": args.fresh_cache, "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None}

    def save():
        (out / "repro.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "repro.md").write_text(markdown(report))

    if "runs" in args.stages:
        report["runs"] = []
        for mode in args.modes:
            report["runs"].append(run_mode(mode, base, args.steps, out, args.fresh_cache, args.timeout))
            save()
    # the in-process stages switch modes after cuBLAS has started: give both modes the fixed workspace
    # the deterministic one needs from the start. Only now: the runs above, each its own process,
    # inherit this environment, and the default mode's must be the user's default.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    def runs_differed(mode: str) -> bool:  # True where not known
        run = next((r for r in report.get("runs", []) if r["mode"] == mode), {})
        return verdict(run.get("a_vs_b")) != "bitwise"

    for stage, measure in (("kernels", lambda mode: {name: repeat_compare(op) for name, op in
                                                     kernel_probes(shape, device).items()}),
                           ("gradients", lambda mode: gradient_checks(shape, device, runs_differed(mode)))):
        if stage in args.stages:
            report[stage] = {}
            for mode in args.modes:
                print(f"  {stage} ({mode})", flush=True)
                with deterministic_kernels(mode == "deterministic"):
                    report[stage][mode] = measure(mode)
                save()
    save()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
