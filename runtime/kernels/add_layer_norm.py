"""A residual add and the layer norm that reads its result, one kernel forward and one backward.

In a pre-LayerNorm block the residual stream is updated, `z = x + attn(ln_1(x))`, and at once normalised,
`ln_2(z)`. Run op by op (eager mode), that is two kernels: the add reads x and the branch and writes z; the
layer norm reads z again and writes its output; the backward likewise adds the layer norm's gradient to the
residual's in a kernel of its own. Fused, the forward reads x and the branch once and writes z and the output;
the backward reads z, the two incoming gradients and the saved row statistics once, and writes the gradient
of x (the same tensor is the branch's: d(x + y)/dx = d(x + y)/dy = 1) and partial sums of the weight's and the
bias's gradients. torch.compile already fuses this pair (Inductor's `fused_add_native_layer_norm` kernels);
this is for the graphs that it does not compile.

Shapes: x, the branch and z (N, C) over the N = B*T positions; the layer norm's weight and bias (C,); the row
statistics mean and rstd = 1/sqrt(var + eps) (N,), float32. Every sum is in float32. The forward's outputs
are in the dtype torch's `x + branch` has (the residual stream's float32 under autocast, whose layer norm
also runs in float32), so the result matches the unfused ops; the torch fallback is those very ops
(`x + branch`, aten's native_layer_norm and its backward), bitwise what eager runs.
"""

from __future__ import annotations

import torch

from runtime.kernels.triton_support import kernel_runs_on, tl, triton

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # float64 runs the fallback (numerical checks)


if triton is not None:

    @triton.jit
    def _add_layer_norm_forward_kernel(x_ptr, y_ptr, w_ptr, b_ptr, z_ptr, out_ptr, mean_ptr, rstd_ptr, eps,
                                       n_cols: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
        """Row `program_id`: z = x + y (rounded to z's dtype, as the unfused add stores it), then
        out = (z - mean) * rstd * w + b, with the row's mean and rstd kept for the backward."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        z = (x + y).to(z_ptr.dtype.element_ty)
        tl.store(z_ptr + row * n_cols + cols, z, mask=mask)
        z = z.to(tl.float32)
        mean = tl.sum(z, axis=0) / n_cols
        centred = tl.where(mask, z - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
        out = centred * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            out += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def _add_layer_norm_backward_kernel(dout_ptr, dz_ptr, z_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr,
                                        dw_partial_ptr, db_partial_ptr, n_rows,
                                        n_cols: tl.constexpr, BLOCK: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr):
        """Rows [program_id * ROWS_PER_PROGRAM, ...): with zhat = (z - mean) * rstd and g = dout * w,

            dx = dz + rstd * (g - mean(g) - zhat * mean(g * zhat))     (the layer norm's input gradient,
                                                                         plus the residual stream's own)
        and this program's share of dw = sum over rows of dout * zhat, db = sum of dout, one row of
        dw_partial / db_partial per program (the caller adds those rows up)."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK,), tl.float32)
        db = tl.zeros((BLOCK,), tl.float32)
        for i in range(ROWS_PER_PROGRAM):  # a constant trip count; rows past the end are masked off
            row = pid.to(tl.int64) * ROWS_PER_PROGRAM + i
            row_mask = mask & (row < n_rows)
            offsets = row * n_cols + cols
            z = tl.load(z_ptr + offsets, mask=row_mask, other=0.0).to(tl.float32)
            dout = tl.load(dout_ptr + offsets, mask=row_mask, other=0.0).to(tl.float32)
            dz = tl.load(dz_ptr + offsets, mask=row_mask, other=0.0).to(tl.float32)
            mean = tl.load(mean_ptr + row, mask=row < n_rows, other=0.0)
            rstd = tl.load(rstd_ptr + row, mask=row < n_rows, other=0.0)
            zhat = tl.where(row_mask, (z - mean) * rstd, 0.0)
            g = dout * w
            c1 = tl.sum(g * zhat, axis=0) / n_cols
            c2 = tl.sum(g, axis=0) / n_cols
            dx = dz + rstd * (g - c2 - zhat * c1)
            tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=row_mask)
            dw += dout * zhat
            db += dout
        tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=mask)
        tl.store(db_partial_ptr + pid * n_cols + cols, db, mask=mask)


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The row statistics' dtype: float64 for float64 (as aten keeps them), else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _block(n_cols: int) -> int:
    return triton.next_power_of_2(n_cols)


def _uses_kernel(*tensors: torch.Tensor) -> bool:
    return kernel_runs_on(tensors[0]) and all(t.dtype in KERNEL_DTYPES for t in tensors)


@torch.library.custom_op("gpt2_repro::add_layer_norm", mutates_args=())
def add_layer_norm_op(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, y (N, C) -> (z = x + y, layer_norm(z) (N, C), mean (N,), rstd (N,)) in the dtypes of the unfused ops."""
    n_rows, n_cols = x.shape
    dtype = torch.promote_types(x.dtype, y.dtype)
    if not _uses_kernel(x, y, weight):
        with torch.autocast(x.device.type, enabled=False):
            z = x + y
            out, mean, rstd = torch.native_layer_norm(z, [n_cols], weight, bias, eps)  # mean, rstd (N, 1)
        return z, out, mean.view(n_rows).to(stats_dtype(dtype)), rstd.view(n_rows).to(stats_dtype(dtype))
    z, out = torch.empty((n_rows, n_cols), dtype=dtype, device=x.device), torch.empty_like(x, dtype=dtype)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if n_rows:
        _add_layer_norm_forward_kernel[(n_rows,)](x, y, weight, weight if bias is None else bias, z, out, mean, rstd,
                                                  eps, n_cols=n_cols, BLOCK=_block(n_cols), HAS_BIAS=bias is not None,
                                                  num_warps=4 if n_cols <= 2048 else 8)
    return z, out, mean, rstd


@add_layer_norm_op.register_fake
def _(x, y, weight, bias, eps):
    n_rows, n_cols = x.shape
    dtype = torch.promote_types(x.dtype, y.dtype)
    stats = x.new_empty(n_rows, dtype=stats_dtype(dtype))
    return x.new_empty((n_rows, n_cols), dtype=dtype), x.new_empty((n_rows, n_cols), dtype=dtype), stats, \
        torch.empty_like(stats)


@torch.library.custom_op("gpt2_repro::add_layer_norm_backward", mutates_args=())
def add_layer_norm_backward_op(dout: torch.Tensor, dz: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of add_layer_norm_op: (dx (N, C) in z's dtype, dweight (C,), dbias (C,), both in the
    weight's dtype; dbias zeros when there is no bias)."""
    n_rows, n_cols = z.shape
    if not _uses_kernel(dout, dz, z, weight):
        with torch.autocast(z.device.type, enabled=False):
            dz_norm, dweight, dbias = torch.ops.aten.native_layer_norm_backward(
                dout, z, [n_cols], mean.view(n_rows, 1), rstd.view(n_rows, 1), weight, bias,
                [True, True, bias is not None])
            dx = dz + dz_norm  # z's two gradients, as autograd adds them (addition commutes: the same bits)
        return dx, dweight, torch.zeros_like(weight) if dbias is None else dbias
    rows_per_program = 16
    programs = triton.cdiv(n_rows, rows_per_program)
    dx = torch.empty_like(z)
    dw_partial = torch.empty((programs, n_cols), dtype=torch.float32, device=z.device)
    db_partial = torch.empty_like(dw_partial)
    if n_rows:
        _add_layer_norm_backward_kernel[(programs,)](dout, dz, z, weight, mean, rstd, dx, dw_partial, db_partial,
                                                     n_rows, n_cols=n_cols, BLOCK=_block(n_cols),
                                                     ROWS_PER_PROGRAM=rows_per_program,
                                                     num_warps=4 if n_cols <= 2048 else 8)
    return dx, dw_partial.sum(0).to(weight.dtype), db_partial.sum(0).to(weight.dtype)


@add_layer_norm_backward_op.register_fake
def _(dout, dz, z, weight, bias, mean, rstd):
    return torch.empty_like(z), torch.empty_like(weight), torch.empty_like(weight)


def _setup_context(ctx, inputs, output) -> None:
    x, y, weight, bias, _ = inputs
    z, _, mean, rstd = output
    ctx.save_for_backward(z, weight, bias, mean, rstd)
    ctx.dtypes = x.dtype, y.dtype


def _backward(ctx, dz, dout, _dmean, _drstd):
    z, weight, bias, mean, rstd = ctx.saved_tensors
    dz = torch.zeros_like(z) if dz is None else dz  # an output nothing read has no gradient
    dout = torch.zeros_like(z) if dout is None else dout
    dx, dweight, dbias = add_layer_norm_backward_op(dout.contiguous(), dz.contiguous(), z, weight, bias, mean, rstd)
    x_dtype, y_dtype = ctx.dtypes
    # d(x + y)/dx = d(x + y)/dy = 1: both get dx, each in its own dtype (as autograd's add casts it)
    return dx.to(x_dtype), dx.to(y_dtype), dweight, None if bias is None else dbias, None


add_layer_norm_op.register_autograd(_backward, setup_context=_setup_context)


def add_layer_norm(x: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + branch, layer_norm(x + branch)) for x and branch (..., C): the residual stream after the add, and the
    layer norm's output, as `z = x + branch; F.layer_norm(z, (C,), weight, bias, eps)` gives them."""
    shape = torch.broadcast_shapes(x.shape, branch.shape)
    C = shape[-1]
    z, out, _, _ = add_layer_norm_op(x.expand(shape).reshape(-1, C), branch.expand(shape).reshape(-1, C),
                                     weight, bias, eps)
    return z.view(shape), out.view(shape)
