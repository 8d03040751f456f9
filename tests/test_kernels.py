"""runtime/kernels/: each op against the torch ops it replaces, by its torch fallback and by its Triton kernel.

The kernel cases (marker `triton`) run the Triton kernels on CPU tensors through Triton's interpreter:
`make test-triton` runs them in an environment with Triton and TRITON_INTERPRET=1; elsewhere (make test)
they skip, saying why. The interpreter runs each program of a grid in turn, in numpy, so the sizes are
small in rows (a GPT-2 row of 50,304 logits is four blocks of the kernel's 32,768 columns, in two passes)
but the vocabulary, row strides and dtypes are the trainer's.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from model import GPT, GPTConfig
from runtime.kernels import add_layer_norm as add_norm_module
from runtime.kernels import cross_entropy as ce_module
from runtime.kernels.add_layer_norm import add_layer_norm
from runtime.kernels.cross_entropy import cross_entropy
from runtime.kernels.fp8 import E4M3, E5M2, fp8_linear, to_fp8
from runtime.kernels.heads import make_loss_head
from runtime.kernels.triton_support import interpreting, kernels_available, triton

GPT2_VOCAB = 50304
# float32 bounds: the loss relative (a few float32 ulps of a loss near ln(50304) = 10.8, where one ulp is 1e-6),
# each gradient entry absolute (they are at most 1/N)
LOSS_RTOL, GRAD_ATOL = 1e-6, 1e-6
BF16_RTOL = 2**-7  # one bf16 rounding either way (8 bits of mantissa)


@pytest.fixture(params=["torch", pytest.param("triton", marks=pytest.mark.triton)])
def implementation(request, monkeypatch) -> str:
    """Each case twice: by the ops' torch fallback (the Triton kernels switched off), and by the Triton kernels,
    which need Triton and, on the CPU, its interpreter."""
    if request.param == "torch":
        monkeypatch.setattr(ce_module, "kernel_runs_on", lambda t: False)
        monkeypatch.setattr(add_norm_module, "kernel_runs_on", lambda t: False)
    elif triton is None:
        pytest.skip("Triton is not installed here (make test-triton runs these cases in .venv-triton)")
    elif not kernels_available(torch.device("cpu")):
        pytest.skip(f"Triton's interpreter is off (TRITON_INTERPRET={'1' if interpreting() else 'unset'} when "
                    "runtime/kernels/ was imported; make test-triton sets it)")
    return request.param


def reference_loss(logits: torch.Tensor, targets: torch.Tensor, scale: float):
    """model.py's loss (float32 F.cross_entropy) times scale: (loss, d(scale * loss)/d(logits))."""
    logits = logits.detach().clone().requires_grad_()
    loss = F.cross_entropy(logits.float(), targets)
    (loss * scale).backward()
    return loss.detach(), logits.grad


# (rows, vocabulary, padding of each row): GPT-2's padded vocabulary and its real one, a small odd one, and rows
# that are a slice of wider ones (a row stride of V + padding, as logits[:, :50257] of the padded vocabulary)
SHAPES = [(4, GPT2_VOCAB, 0), (3, 50257, 47), (5, 1000, 0), (3, 17, 3)]


@pytest.mark.parametrize("rows,vocab,padding", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_pass_loss_and_its_gradient_are_f_cross_entropys(implementation, rows, vocab, padding, dtype):
    generator = torch.Generator().manual_seed(rows * vocab)
    wide = (torch.randn(rows, vocab + padding, generator=generator) * 3).to(dtype)
    logits = wide[:, :vocab]  # (rows, V) with row stride V + padding
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[0] = vocab - 1  # the last column, where a block's mask ends
    expected_loss, expected_grad = reference_loss(logits, targets, scale=0.25)  # 1/grad_accum_steps, say

    consumed = logits.detach().clone().requires_grad_() if padding == 0 else wide.clone()[:, :vocab].requires_grad_()
    loss = cross_entropy(consumed, targets)
    (loss * 0.25).backward()
    if dtype == torch.float32:
        assert abs(loss.item() - expected_loss.item()) <= LOSS_RTOL * expected_loss.item()
        torch.testing.assert_close(consumed.grad, expected_grad, rtol=0, atol=GRAD_ATOL)
    else:  # the loss in float32 from the same bf16 logits; the gradient rounded to bf16, as the plain path's is
        assert abs(loss.item() - expected_loss.item()) <= LOSS_RTOL * expected_loss.item()
        assert consumed.grad.dtype == torch.bfloat16
        torch.testing.assert_close(consumed.grad.float(), expected_grad.float(), rtol=BF16_RTOL, atol=1e-7)


def test_the_logits_buffer_holds_the_gradient_of_the_mean_after_the_forward(implementation):
    """What lets the backward skip the logits: the forward already wrote d(mean loss)/d(logits) into them."""
    logits, targets = torch.randn(3, GPT2_VOCAB), torch.tensor([0, 7, GPT2_VOCAB - 1])
    _, expected_grad = reference_loss(logits, targets, scale=1.0)
    buffer = logits.clone()
    with torch.no_grad():
        cross_entropy(buffer, targets)
    torch.testing.assert_close(buffer, expected_grad, rtol=0, atol=GRAD_ATOL)


def test_the_trainers_forward_with_the_one_pass_loss_matches_the_plain_one(implementation):
    """GPT.forward with the runtime's loss head (loss_kernel triton) against its own plain path: the loss and
    every parameter's gradient, float32, GPT-2's vocabulary, rows of (B, T) = (2, 2) flattened as the trainer does."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=GPT2_VOCAB, n_layer=1, n_head=2, n_embd=32))
    idx, targets = torch.randint(0, 50257, (2, 2)), torch.randint(0, 50257, (2, 2))
    results = []
    for head in (None, make_loss_head("triton", fp8_lm_head=False)):
        model.zero_grad()
        logits, loss = model(idx, targets, loss_head=head)
        assert (logits is None) == (head is not None)  # the kernel's logits hold the gradient: never returned
        (loss / 2).backward()  # as the trainer scales each micro-step's loss
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain_loss, plain_grads), (loss, grads) = results
    assert abs(loss - plain_loss) <= LOSS_RTOL * plain_loss
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.slow  # torch.compile traces the model (about 45 s on 2 busy cores: make test-triton's alone)
@pytest.mark.parametrize("implementation", [pytest.param("triton", marks=pytest.mark.triton)], indirect=True)
def test_torch_compile_sees_the_loss_as_one_op_with_its_fake(implementation):
    """Dynamo traces the custom op through its fake implementation (fullgraph: no break), and AOTAutograd
    functionalises its in-place write; the compiled loss and gradients, the Triton kernel's inside the compiled
    graph, are the eager ones."""
    torch.manual_seed(0)
    x, weight = torch.randn(6, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(0, 40, (6,))
    head = make_loss_head("triton", fp8_lm_head=False)
    eager = head(x, weight, targets)
    expected = torch.autograd.grad(eager, (x, weight))
    compiled = torch.compile(head, backend="aot_eager", fullgraph=True)(x, weight, targets)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    for got, want in zip(torch.autograd.grad(compiled, (x, weight)), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def unfused(x, branch, weight, bias, eps):
    z = x + branch
    return z, F.layer_norm(z, (z.size(-1),), weight, bias, eps)


# (C, the residual stream's dtype, the branch's, bias): the trainer's (float32 stream, bf16 branch under autocast),
# GPT-2's width, an odd one without bias, all-bf16, and float64 (always the fallback)
NORM_CASES = [(64, torch.float32, torch.float32, True), (768, torch.float32, torch.bfloat16, True),
              (50, torch.float32, torch.float32, False), (96, torch.bfloat16, torch.bfloat16, True),
              (64, torch.float64, torch.float64, True)]


@pytest.mark.parametrize("C,x_dtype,branch_dtype,bias", NORM_CASES)
def test_the_fused_residual_add_and_layer_norm_are_the_two_ops(implementation, C, x_dtype, branch_dtype, bias):
    """Outputs and every input's gradient, with gradients flowing into both outputs (the residual stream goes on
    past the layer norm). The torch fallback is the same ops: bitwise. The kernel: float32 within 1e-6 of each
    tensor's largest entry (its sums over C run in another order: x's gradient adds two terms of size ~1 that
    may cancel to ~1e-3), bf16 within a rounding."""
    generator = torch.Generator().manual_seed(C)
    shape = (2, 19, C)  # 38 rows: the backward's programs take 16 rows each, the last one 6
    weight_dtype = torch.float64 if x_dtype == torch.float64 else torch.float32
    inputs = [torch.randn(shape, generator=generator).to(x_dtype), torch.randn(shape, generator=generator).to(branch_dtype),
              (torch.randn(C, generator=generator) + 1).to(weight_dtype),
              torch.randn(C, generator=generator).to(weight_dtype) if bias else None]
    grads_out = [torch.randn(shape, generator=generator) for _ in range(2)]
    results = []
    for fn in (unfused, add_layer_norm):
        leaves = [t.clone().requires_grad_() if t is not None else None for t in inputs]
        z, out = fn(*leaves, 1e-5)
        ((z * grads_out[0].to(z.dtype)).sum() + (out * grads_out[1].to(out.dtype)).sum()).backward()
        results.append([z, out, *(t.grad for t in leaves if t is not None)])
    for got, want in zip(*reversed(results)):
        assert got.dtype == want.dtype and got.shape == want.shape
        if implementation == "torch" or x_dtype == torch.float64:
            assert torch.equal(got, want)
        elif x_dtype == torch.float32:
            assert (got - want).abs().max() <= 1e-6 * want.abs().max()
        else:  # the interpreter rounds to bf16 by truncation: a bf16 ulp or two, more for sums over 38 rows
            torch.testing.assert_close(got.float(), want.float(), rtol=2 * BF16_RTOL, atol=0.1)


def test_a_model_with_fused_residual_norms_trains_like_the_plain_one(implementation):
    """GPT.fuse_residual_norms: the loss and the gradients of a step, float32: the same bits by the fallback
    (the same ops), within 1e-6 by the kernel."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 64, (2, 16))
    results = []
    for add_norm in (None, add_layer_norm):
        model.fuse_residual_norms(add_norm)
        model.zero_grad()
        _, loss = model(idx, idx)
        loss.backward()
        results.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain_loss, plain_grads), (loss, grads) = results
    if implementation == "torch":
        assert torch.equal(loss, plain_loss) and all(torch.equal(grads[n], plain_grads[n]) for n in grads)
    else:
        torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-6, msg=name)


# --- FP8: torch._scaled_mm runs on the CPU too, so its math is checked here; the trainer refuses FP8 off CUDA ---

def test_fp8_scales_are_powers_of_two_that_keep_every_value_in_range():
    t = torch.tensor([[0.0, -3.0e-3, 1.5], [700.0, -2.0, 0.25]])
    for dtype in (E4M3, E5M2):
        t8, scale = to_fp8(t, dtype)
        assert scale == 2.0 ** torch.ceil(torch.log2(t.abs().max() / torch.finfo(dtype).max))
        assert t8.float().abs().max() <= torch.finfo(dtype).max
        assert torch.allclose(t8.float() * scale, t, rtol=2**-2, atol=scale.item() * 2**-6)  # within FP8's rounding
    zeros8, scale = to_fp8(torch.zeros(2, 3), E4M3)
    assert scale == 1 and not zeros8.float().any()


def test_the_fp8_lm_head_is_its_dequantized_matrix_products():
    """Forward and both gradients equal the float32 products of the dequantized FP8 operands (the only rounding
    left: float32 sums in another order, and the bf16 result); and stay near the bf16 products."""
    torch.manual_seed(0)
    x, weight = torch.randn(32, 64, requires_grad=True), (torch.randn(48, 64) * 0.02).requires_grad_()
    grad = torch.randn(32, 48).to(torch.bfloat16)
    logits = fp8_linear(x.to(torch.bfloat16), weight)
    assert logits.dtype == torch.bfloat16
    logits.backward(grad)

    def dequantized(t, dtype):
        t8, scale = to_fp8(t.detach(), dtype)
        return t8.float() * scale

    xq, wq, gq = dequantized(x.to(torch.bfloat16), E4M3), dequantized(weight, E4M3), dequantized(grad, E5M2)
    torch.testing.assert_close(logits.float(), (xq @ wq.t()).to(torch.bfloat16).float(), rtol=BF16_RTOL, atol=1e-6)
    torch.testing.assert_close(x.grad, (gq @ wq).to(torch.bfloat16).float(), rtol=BF16_RTOL, atol=1e-6)
    torch.testing.assert_close(weight.grad, gq.t() @ xq, rtol=1e-5, atol=1e-6)
    exact = x.detach() @ weight.detach().t()
    assert torch.linalg.norm(logits.float() - exact) <= 0.1 * torch.linalg.norm(exact)  # FP8: 3 mantissa bits
