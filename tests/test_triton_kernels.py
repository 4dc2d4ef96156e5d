"""Every Triton kernel against its torch reference, and every reference against float64 math.

The kernels run on CPU tensors in the Triton interpreter (conftest.py sets TRITON_INTERPRET=1
before triton_kernels is imported). Outputs are poisoned with NaN before each call so any element
a kernel forgets to write fails the comparison.

Tolerances (max abs error relative to the largest reference magnitude):
  fp32: 1e-5 (fp32 accumulation in a different order than torch's CPU matmul)
  bf16: 1e-2 (one bf16 ulp is 2^-8 ~ 4e-3 relative: allow two ulps and some accumulation noise)
  The FP8 up-projection is compared bit for bit, on inputs whose fp32 sums are exact in any order
  (conftest.py makes the interpreter's bf16 and float8 casts round like the GPU's).
  fp64: 1e-12
"""
import os
import subprocess
import sys
import types

import pytest
import torch

import triton
import triton.language as tl

import triton_kernels as tk

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float64: 1e-12}


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """max |actual - expected| <= tol * max |expected|, NaNs failing."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.double(), expected.double()
    assert torch.isfinite(a).all(), "output has NaN/inf (an element was not written?)"
    scale = e.abs().max().clamp_min(1e-30)
    err = (a - e).abs().max()
    assert err <= tol * scale, f"max abs error {err.item():.3e} > {tol:g} * {scale.item():.3e}"


def nan_like(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def test_interpreter_is_active():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert tk._is_interpreted(tk._sym_mm_kernel), "conftest must set TRITON_INTERPRET before import"


# ----------------------------------------------------------------------------------------------
# References against float64 math
# ----------------------------------------------------------------------------------------------


def test_symmetric_references_match_float64():
    A = torch.randn(3, 20, 33)
    A64 = A.double()
    out = nan_like((3, 20, 20), torch.float32)
    assert_close_rel(tk.XXT_reference(A, out), torch.einsum("bik,bjk->bij", A64, A64), 1e-5)
    out = nan_like((3, 33, 33), torch.float32)
    assert_close_rel(tk.XTX_reference(A, out), torch.einsum("bki,bkj->bij", A64, A64), 1e-5)
    S = tk.XXT_reference(A, torch.empty(3, 20, 20)) / 30
    S64 = S.double()
    out = nan_like((3, 20, 20), torch.float32)
    expected = 0.7 * torch.einsum("bik,bkj->bij", S64, S64) - 1.3 * S64
    assert_close_rel(tk.ba_plus_cAA_reference(S, 0.7, -1.3, out), expected, 1e-5)


def test_mlp_reference_matches_float64():
    x, wu, wd = torch.randn(17, 8), torch.randn(24, 8), torch.randn(24, 8)
    pre = x.double() @ wu.double().T
    expected = torch.where(pre > 0, pre * pre, torch.zeros_like(pre)) @ wd.double()
    assert_close_rel(tk.relu2_mlp_reference(x, wu, wd), expected, 1e-5)


def sigma_bf16_float64(logits: torch.Tensor) -> torch.Tensor:
    """Record #89's stored sigma: 0.5 + 0.5 tanh(x / 2), x = (l + 5) / 7.5, rounded to bf16 (from fp32)."""
    x = (logits.double() + 5.0) / 7.5
    return (0.5 + 0.5 * torch.tanh(x / 2)).float().bfloat16().double()


def ce_record_float64(logits, targets, weights, prefix_ids=None, prefix_weight=0.0, grad_scale=1.0):
    """The record's per-token loss (T,) and gradient (T, V) in float64, one loop per term, written from
    Record #89's loss: z = 23 bf16(sigma); L_i = sum_{k, i+k<T} w_k (lse_i - z_i[tgt_{i+k}])
    + [prefix valid] pi (lse_i - z_i[prefix_i]); dl_i = grad_scale (S_i p_i - hits_i) 23/7.5 sigma (1 - sigma)
    with S_i = sum of ALL w_k + pi [valid]; no upstream gradient enters."""
    sigma = sigma_bf16_float64(logits)
    z = 23.0 * sigma
    T, V = z.shape
    losses, grads = [], []
    for i in range(T):
        lse = torch.log(torch.exp(z[i]).sum())
        loss = torch.zeros((), dtype=torch.float64)
        hits = torch.zeros(V, dtype=torch.float64)
        S = 0.0
        for k, w in enumerate(weights):
            S += float(w)
            if i + k < T:
                loss = loss + float(w) * (lse - z[i, targets[i + k]])
                hits[targets[i + k]] += float(w)
        if prefix_ids is not None and prefix_ids[i] >= 0:
            S += float(prefix_weight)
            loss = loss + float(prefix_weight) * (lse - z[i, prefix_ids[i]])
            hits[prefix_ids[i]] += float(prefix_weight)
        p = torch.exp(z[i] - lse)
        grads.append(grad_scale * (S * p - hits) * (23.0 / 7.5) * sigma[i] * (1.0 - sigma[i]))
        losses.append(loss)
    return torch.stack(losses), torch.stack(grads)


def ce_inputs(T, V, K=3, prefix=True, seed=0, dtype=torch.float32):
    """Logits, targets, K weights and (prefix ids with -1s, pi) for the CE tests."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, V, generator=g) * 6).to(dtype)
    targets = torch.randint(0, V, (T,), generator=g)
    weights = torch.tensor([1.0, 0.5, 0.25][:K])
    if not prefix:
        return logits, targets, weights, None, None
    prefix_ids = torch.randint(0, V, (T,), generator=g)
    prefix_ids[::3] = -1  # no prefix token (single bytes, BOS)
    return logits, targets, weights, prefix_ids, torch.tensor(0.25)


def test_ce_reference_matches_float64():
    logits, targets, w, prefix, pi = ce_inputs(9, 50)
    lr = logits.clone().requires_grad_(True)
    loss = tk.softcapped_ce_mtp_reference(lr, targets, w, prefix, pi, grad_scale=0.37)
    want_loss, want_grad = ce_record_float64(logits, targets, w, prefix, 0.25, grad_scale=0.37)
    assert_close_rel(loss, want_loss, 1e-5)
    (g,) = torch.autograd.grad(loss, lr, torch.randn(9))  # the upstream gradient is ignored
    assert_close_rel(g, want_grad, 1e-5)


def test_transpose_references():
    src = torch.randn(5, 7)
    dst = nan_like((7, 5), torch.float32)
    assert torch.equal(tk.transpose_copy_reference(src, dst), src.T)
    base = torch.randn(7, 5)
    assert torch.equal(tk.transpose_add_reference(src, base.clone()), base + src.T)


# ----------------------------------------------------------------------------------------------
# Symmetric products
# ----------------------------------------------------------------------------------------------

# Interpreter tiles are 32x32: 64 is a multiple, the others leave ragged edges; 300 gives 55
# lower-triangle tiles walked by 3 persistent programs (exercising the triangle indexing).
SYM_SHAPES = [(64, 64), (45, 70), (100, 37), (2, 33, 50), (3, 40, 29), (300, 40)]

# The symmetric kernels are checked against float64 products of the same (rounded) inputs, never
# against torch's or numpy's fp32 matmul: a CPU BLAS sums in an order that depends on the CPU's
# vector ISA (AVX-512 vs AVX2 kernels), and the interpreter's tl.dot is numpy's BLAS. Against
# float64 the only error is the kernel's own: fp32 accumulation (well under TOL[fp32] for these
# K <= 300) and, for bf16 outputs, one rounding of the fp32 result (<= 2^-7 relative, < TOL[bf16]).


def xxt64(A: torch.Tensor) -> torch.Tensor:
    A64 = A.double()
    return A64 @ A64.mT


def xtx64(A: torch.Tensor) -> torch.Tensor:
    A64 = A.double()
    return A64.mT @ A64


def assert_exactly_symmetric(out: torch.Tensor) -> None:
    """Bitwise out == out^T, batched or not (Polar Express assumes it; the kernels guarantee it)."""
    bad = (out != out.mT).sum().item()
    assert bad == 0, f"{bad} elements differ from their mirror image"


def symmetric_gram(shape, dtype) -> torch.Tensor:
    """An exactly symmetric (..., m, m) matrix with O(1) entries, like the Polar Express Gram."""
    X = torch.randn(*shape[:-2], shape[-1], 2 * shape[-1], dtype=torch.float64)
    S = X @ X.mT / shape[-1]
    return ((S + S.mT) / 2).to(dtype)  # a + b == b + a exactly; rounding is elementwise


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SYM_SHAPES)
def test_xxt_matches_reference(shape, dtype):
    A = torch.randn(shape, dtype=dtype)
    m = shape[-2]
    out = nan_like((*shape[:-2], m, m), dtype)
    got = tk.XXT_triton(A, out)
    assert got is out
    assert_close_rel(out, xxt64(A), TOL[dtype])
    assert_exactly_symmetric(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SYM_SHAPES)
def test_xtx_matches_reference(shape, dtype):
    A = torch.randn(shape, dtype=dtype)
    n = shape[-1]
    out = nan_like((*shape[:-2], n, n), dtype)
    tk.XTX_triton(A, out)
    assert_close_rel(out, xtx64(A), TOL[dtype])
    assert_exactly_symmetric(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 64), (45, 45), (3, 70, 70), (130, 130)])
def test_ba_plus_caa_matches_reference(shape, dtype):
    S = symmetric_gram(shape, dtype)
    assert_exactly_symmetric(S)
    alpha, beta = 15.878769915207462, -22.48329292557795
    out = nan_like(shape, dtype)
    tk.ba_plus_cAA_triton(S, alpha, beta, out)
    S64 = S.double()
    assert_close_rel(out, alpha * (S64 @ S64) + beta * S64, TOL[dtype])
    assert_exactly_symmetric(out)


def _asymmetric_dot(monkeypatch):
    """Make the interpreter's tl.dot round the upper triangle of every tile one ulp up.

    (r, c) and (c, r) of a diagonal tile are separate dot products; a BLAS (or the tensor cores) may
    sum them in different orders. This makes every tile's raw product asymmetric on any CPU, so the
    test below fails unless the kernel makes its output symmetric by construction."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        out = original(self, a, b, d, input_precision, max_num_imprecise_acc)
        data = out.data
        upper = np.triu(np.ones(data.shape[-2:], dtype=bool), 1)
        return interpreter.TensorHandle(np.where(upper, np.nextafter(data, np.inf), data), out.dtype.scalar)

    monkeypatch.setattr(builder, "create_dot", create_dot)


@pytest.mark.parametrize("mode", ["xxt", "xtx", "aa"])
def test_symmetric_by_construction_whatever_the_dot_order(mode, monkeypatch):
    _asymmetric_dot(monkeypatch)
    if mode == "aa":
        A = symmetric_gram((70, 70), torch.float32)  # 3 x 3 tiles, ragged last row of tiles
        out = nan_like((70, 70), torch.float32)
        tk.ba_plus_cAA_triton(A, 0.7, -1.3, out)
        A64 = A.double()
        expected = 0.7 * (A64 @ A64) - 1.3 * A64
    else:
        A = torch.randn(2, 70, 45)
        n = 70 if mode == "xxt" else 45
        out = nan_like((2, n, n), torch.float32)
        (tk.XXT_triton if mode == "xxt" else tk.XTX_triton)(A, out)
        expected = xxt64(A) if mode == "xxt" else xtx64(A)
    assert_close_rel(out, expected, TOL[torch.float32])
    assert_exactly_symmetric(out)


def test_symmetric_float64_and_strided_input():
    A = torch.randn(50, 90, dtype=torch.float64).T  # non-contiguous (90, 50) view
    out = nan_like((90, 90), torch.float64)
    tk.XXT_triton(A, out)
    assert_close_rel(out, A @ A.T, TOL[torch.float64])
    assert_exactly_symmetric(out)
    out = nan_like((50, 50), torch.float64)
    tk.XTX_triton(A, out)
    assert_close_rel(out, A.T @ A, TOL[torch.float64])
    assert_exactly_symmetric(out)


def test_symmetric_gpu_tile_config():
    """The 128x128 and 64x64 configurations chosen for H100 compute the same thing."""
    A = torch.randn(2, 200, 150)
    for cfg in (dict(BLOCK=128, BLOCK_K=64, num_warps=8, num_stages=4),
                dict(BLOCK=64, BLOCK_K=64, num_warps=4, num_stages=4)):
        out = nan_like((2, 200, 200), torch.float32)
        grid, args, meta = tk._sym_args(A, out, "xxt", config=cfg)
        tk._sym_mm_kernel[grid](*args, **meta)
        assert_close_rel(out, xxt64(A), TOL[torch.float32])
        assert_exactly_symmetric(out)


def test_polar_express_iteration_with_kernels():
    """One Polar Express step built from the kernels equals the same step in float64."""
    a, b, c = 8.156554524902461, -22.48329292557795, 15.878769915207462
    X = torch.randn(48, 96)
    X = X / (X.norm() * 1.02 + 1e-6)
    Amat = tk.XXT_triton(X, nan_like((48, 48), torch.float32))
    B = tk.ba_plus_cAA_triton(Amat, c, b, nan_like((48, 48), torch.float32))
    got = a * X + B @ X
    X64 = X.double()
    A64 = X64 @ X64.T
    expected = a * X64 + (b * A64 + c * A64 @ A64) @ X64
    assert_close_rel(got, expected, 1e-5)


def test_symmetric_errors():
    A = torch.randn(10, 12)
    with pytest.raises(ValueError, match="out must have shape"):
        tk.XXT_triton(A, torch.empty(12, 12))
    with pytest.raises(ValueError, match="square"):
        tk.ba_plus_cAA_triton(A, 1.0, 1.0, torch.empty(10, 10))
    S = torch.randn(10, 10)
    with pytest.raises(ValueError, match="must not overlap"):
        tk.ba_plus_cAA_triton(S, 1.0, 1.0, S)
    with pytest.raises(ValueError, match="2-D"):
        tk.XXT_triton(torch.randn(2, 2, 3, 4), torch.empty(2, 2, 3, 3))


def test_triton_path_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(tk, "_is_interpreted", lambda kernel: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        tk.XXT_triton(torch.randn(4, 4), torch.empty(4, 4))


# ----------------------------------------------------------------------------------------------
# Public dispatch: CPU tensors always take the torch path (references, torch's matmul, CPU twins)
# ----------------------------------------------------------------------------------------------


def test_public_functions_use_reference_on_cpu(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("Triton path taken for a CPU tensor")

    for name in ("_sym_args", "_mm_args", "_transpose_args", "ce_kernel_args", "fp8_up_kernel_args", "XXT_triton",
                 "XTX_triton", "ba_plus_cAA_triton", "relu2_mlp_triton", "softcapped_ce_mtp_triton",
                 "relu2_fp8_up_triton", "transpose_copy_triton", "transpose_add_triton"):
        monkeypatch.setattr(tk, name, boom)
    A = torch.randn(6, 6)
    S = A @ A.T
    tk.XXT(A, torch.empty(6, 6))
    tk.XTX(A, torch.empty(6, 6))
    tk.ba_plus_cAA(S, 1.0, 2.0, torch.empty(6, 6))
    tk.relu2_mlp(torch.randn(3, 6), torch.randn(5, 6), torch.randn(5, 6))
    tk.softcapped_ce_mtp(torch.randn(4, 9), torch.randint(0, 9, (4,)), torch.ones(2))
    tk.softcapped_ce_mtp_e5m2(torch.randn(4, 9), torch.randint(0, 9, (4,)), torch.ones(2), None, None, 1.0, 2.0)
    tk.relu2_mlp_backward(torch.randn(3, 6), torch.randn(3, 6), torch.randn(5, 6), torch.randn(5, 6), torch.rand(3, 5))
    tk.transpose_copy(A, torch.empty(6, 6))
    tk.transpose_add(A, torch.empty(6, 6))


# ----------------------------------------------------------------------------------------------
# Squared-ReLU MLP
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,D,H", [(64, 32, 128), (50, 24, 70), (7, 40, 33)])
def test_mlp_forward_backward_match_reference(T, D, H, dtype):
    x = torch.randn(T, D, dtype=dtype, requires_grad=True)
    wu = (torch.randn(H, D) / D**0.5).to(dtype).requires_grad_(True)
    wd = (torch.randn(H, D) / H**0.5).to(dtype).requires_grad_(True)
    y = tk.relu2_mlp_triton(x, wu, wd)
    assert y.dtype == dtype and y.shape == (T, D)
    # fp32 reference on the same (rounded) inputs
    xr, wur, wdr = (t.detach().float().requires_grad_(True) for t in (x, wu, wd))
    yr = tk.relu2_mlp_reference(xr, wur, wdr)
    assert_close_rel(y, yr, TOL[dtype])
    dy = torch.randn(T, D, dtype=dtype)
    grads = torch.autograd.grad(y, (x, wu, wd), dy)
    grads_ref = torch.autograd.grad(yr, (xr, wur, wdr), dy.float())
    # bf16 gradients pass through two bf16-stored intermediates (post and dpre): allow 2x.
    tol = TOL[dtype] * (2 if dtype == torch.bfloat16 else 1)
    for g, gr, name in zip(grads, grads_ref, ("dx", "dw_up", "dw_down")):
        assert g.dtype == dtype, name
        assert_close_rel(g, gr, tol)


@pytest.mark.parametrize("fn", [pytest.param(lambda: tk.relu2_mlp_triton, id="triton"),
                                pytest.param(lambda: tk.relu2_mlp_reference, id="reference"),
                                pytest.param(lambda: tk.relu2_mlp, id="cpu_path")])
def test_mlp_gradcheck_float64(fn):
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    wu = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    wd = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fn(), (x, wu, wd), eps=1e-6, atol=1e-7)


def test_mlp_batched_leading_dims_and_gpu_config():
    x = torch.randn(2, 30, 16)
    wu, wd = torch.randn(40, 16), torch.randn(40, 16)
    assert_close_rel(tk.relu2_mlp_triton(x, wu, wd), tk.relu2_mlp_reference(x, wu, wd), TOL[torch.float32])
    # the large-shape H100 tiles (128x256x64) on a ragged problem
    a, b = torch.randn(150, 70), torch.randn(70, 300)
    c = nan_like((150, 300), torch.float32)
    grid, args, meta = tk._mm_args(a, b, c, tk._EPI_RELU2, config=dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
                                                                    GROUP_M=8, num_warps=8, num_stages=3))
    tk._mm_epilogue_kernel[grid](*args, **meta)
    assert_close_rel(c, torch.relu(a @ b).square(), TOL[torch.float32])


def _saved_while(fn):
    """Shapes of every tensor autograd saves while fn() runs."""
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def test_mlp_backward_op_compiles_with_inductor_its_default_left_out():
    """The FP8 MLP's backward calls relu2_mlp_backward without use_kernel, and inductor hands the default
    to its fallback kernel by name: a parameter named `kernel` would clash with the fallback's own."""
    x, wu, wd = torch.randn(8, 6), torch.randn(5, 6), torch.randn(5, 6)
    post, dy = torch.relu(x @ wu.T).square(), torch.randn(8, 6)
    want = tk.relu2_mlp_backward(dy, x, wu, wd, post)
    got = torch.compile(lambda *a: tk.relu2_mlp_backward(*a), backend="inductor", fullgraph=True)(dy, x, wu, wd, post)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_mlp_post_only_backward_equals_reference_autograd(impl):
    """Only x, the weights and post (T, H) are saved, never pre; the gradients rebuilt from
    sqrt(post) equal float64 autograd through the reference: to fp64 rounding in float64, and within
    the bf16 tolerance (x2: post and dpre are stored in bf16) from bf16 inputs."""
    fn = tk.relu2_mlp_triton if impl == "triton" else tk.relu2_mlp
    T, D, H = 40, 24, 72
    for dtype, tol in ((torch.float64, 1e-12), (torch.bfloat16, 2 * TOL[torch.bfloat16])):
        x = torch.randn(T, D, dtype=dtype, requires_grad=True)
        wu = (torch.randn(H, D) / D**0.5).to(dtype).requires_grad_(True)
        wd = (torch.randn(H, D) / H**0.5).to(dtype).requires_grad_(True)
        y, saved = _saved_while(lambda: fn(x, wu, wd))
        assert sorted(saved) == sorted([(T, D), (H, D), (H, D), (T, H)]), saved
        dy = torch.randn(T, D, dtype=dtype)
        grads = torch.autograd.grad(y, (x, wu, wd), dy)
        ref_in = [t.detach().double().requires_grad_(True) for t in (x, wu, wd)]
        grads_ref = torch.autograd.grad(tk.relu2_mlp_reference(*ref_in), ref_in, dy.double())
        for g, gr in zip(grads, grads_ref):
            assert g.dtype == dtype
            assert_close_rel(g, gr, tol)


def test_mlp_errors():
    with pytest.raises(ValueError, match="features"):
        tk.relu2_mlp_triton(torch.randn(4, 5), torch.randn(8, 6), torch.randn(8, 6))
    with pytest.raises(ValueError, match=r"\(H, D\)"):
        tk.relu2_mlp_triton(torch.randn(4, 6), torch.randn(8, 6), torch.randn(6, 8))
    with pytest.raises(ValueError, match="dtype"):
        tk.relu2_mlp_triton(torch.randn(4, 6).bfloat16(), torch.randn(8, 6), torch.randn(8, 6))


# ----------------------------------------------------------------------------------------------
# FP8 MLP up-projection
# ----------------------------------------------------------------------------------------------

E4M3 = torch.float8_e4m3fn


def fp8_up_inputs(T, D, H):
    """e4m3 operands holding small integers (|v| <= 15, all exact in e4m3): every partial sum of the
    fp32 accumulation is an integer below 2^24, so the kernel and the reference sum exactly, in any
    order, and must agree bit for bit. The activation scale saturates the top half of post."""
    x_f8 = torch.randint(-15, 16, (T, D)).float().to(E4M3)
    w_f8 = torch.randint(-15, 16, (H, D)).float().to(E4M3)
    dequant = torch.tensor(1.0 / (15 * 15 * D**0.5), dtype=torch.float32)
    acc = (x_f8.float() @ w_f8.float().T) * dequant
    act = (torch.relu(acc) ** 2).max() * 0.5 / 448
    return x_f8, w_f8, dequant, act.float()


def assert_fp8_up_equal(out, ref):
    post, post_f8, amax = out
    ref_post, ref_f8, ref_amax = ref
    assert post.dtype == torch.bfloat16 and post_f8.dtype == E4M3 and post.shape == post_f8.shape == ref_post.shape
    assert torch.equal(post, ref_post)
    assert torch.equal(post_f8.view(torch.uint8), ref_f8.view(torch.uint8))
    assert amax == ref_amax


@pytest.mark.parametrize("fast_accum", [True, False])  # the record's fast accumulation, and fp32 promotion
@pytest.mark.parametrize("T,D,H", [(64, 32, 96), (50, 40, 70), (7, 48, 33)])
def test_fp8_up_kernel_matches_reference(T, D, H, fast_accum):
    x_f8, w_f8, dequant, act = fp8_up_inputs(T, D, H)
    post, post_f8, partial = tk.relu2_fp8_up_triton(x_f8, w_f8, dequant, act, fast_accum=fast_accum)
    ref = tk.relu2_fp8_up_reference(x_f8, w_f8, dequant, act)
    assert_fp8_up_equal((post, post_f8, partial.max()), ref)
    assert (ref[1].float() == 448).any() and (ref[1].float() < 448).any()  # both regimes exercised
    tiles = -(-T // 32) * -(-H // 32)  # one partial maximum per program (the interpreter's 32 x 32 tiles)
    assert partial.shape == (min(tiles, tk._INTERPRETER_PROGRAMS),)


def test_fp8_up_kernel_gpu_tiles_and_public_dispatch(monkeypatch):
    x_f8, w_f8, dequant, act = fp8_up_inputs(150, 160, 300)
    # the H100 tiles (128 x 256, K tiles of 128) on a ragged problem
    cfg = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)
    post, post_f8, partial = tk.relu2_fp8_up_triton(x_f8, w_f8, dequant, act, config=cfg)
    ref = tk.relu2_fp8_up_reference(x_f8, w_f8, dequant, act)
    assert_fp8_up_equal((post, post_f8, partial.max()), ref)
    # the public function on a CPU tensor runs the reference, without launching the kernel
    monkeypatch.setattr(tk, "relu2_fp8_up_triton", lambda *a, **k: pytest.fail("kernel on a CPU tensor"))
    out = tk.relu2_fp8_up(x_f8, w_f8, dequant, act)
    assert_fp8_up_equal(out, ref)
    assert out[2].shape == () and out[2].dtype == torch.float32


def test_fp8_up_errors():
    x_f8, w_f8, dequant, act = fp8_up_inputs(16, 32, 48)
    with pytest.raises(ValueError, match="x_f8 must be a 2-D float8_e4m3fn"):
        tk.relu2_fp8_up(x_f8.float(), w_f8, dequant, act)
    with pytest.raises(ValueError, match="w_up_f8 expects"):
        tk.relu2_fp8_up(x_f8, w_f8[:, :16], dequant, act)
    with pytest.raises(ValueError, match="act_scale must be one float32"):
        tk.relu2_fp8_up_triton(x_f8, w_f8, dequant, act.double())


# ----------------------------------------------------------------------------------------------
# Softcapped cross-entropy with multi-token prediction and the prefix-token term
# ----------------------------------------------------------------------------------------------


# The Triton kernel and its CPU twin (the same fused algorithm in torch ops, row blocks of CE_CPU_ROWS)
CE_IMPLS = [pytest.param(lambda: tk.softcapped_ce_mtp_triton, id="triton"),
            pytest.param(lambda: tk.softcapped_ce_mtp_rows, id="rows")]
CE_ALL = CE_IMPLS + [pytest.param(lambda: tk.softcapped_ce_mtp_reference, id="reference")]


def run_ce(fn, logits, targets, w, prefix_ids, prefix_weight, grad_scale, upstream):
    """(loss, dloss/dlogits) with `upstream` sent into the loss."""
    lr = logits.clone().requires_grad_(True)
    loss = fn(lr, targets, w, prefix_ids, prefix_weight, grad_scale=grad_scale)
    (g,) = torch.autograd.grad(loss, lr, upstream)
    return loss, g


@pytest.mark.parametrize("impl", CE_IMPLS)
@pytest.mark.parametrize("K,prefix", [(1, False), (3, False), (1, True), (2, True), (3, True)])
@pytest.mark.parametrize("V", [256, 300])
def test_ce_matches_the_records_loss_and_gradient(V, K, prefix, impl):
    T = 24
    logits, targets, w, prefix_ids, pi = ce_inputs(T, V, K, prefix, seed=K)
    targets[0], targets[1] = V - 1, 0  # vocab edges
    loss, g = run_ce(impl(), logits, targets, w, prefix_ids, pi, 0.37, torch.randn(T))
    want_loss, want_grad = ce_record_float64(logits, targets, w, prefix_ids, 0.25, grad_scale=0.37)
    assert loss.dtype == torch.float32 and loss.shape == (T,) and g.dtype == torch.float32
    assert_close_rel(loss, want_loss, TOL[torch.float32])
    assert_close_rel(g, want_grad, TOL[torch.float32])


def next_token_float64(logits, targets):
    """Evaluation's per-token cross-entropy of the training loss's softcapped logits, in float64:
    -log_softmax(z)[target] with z = 23 bf16(sigma)."""
    z = 23.0 * sigma_bf16_float64(logits)
    return -torch.log_softmax(z, dim=1).gather(1, targets.long()[:, None]).squeeze(1)


@pytest.mark.parametrize("impl", CE_ALL)
@pytest.mark.parametrize("K,prefix", [(1, False), (3, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ce_next_token_loss_is_evaluations_cross_entropy(dtype, K, prefix, impl):
    """next_token=True also returns the plain next-token loss (no weights, no other targets) from the
    same pass, without a gradient; the loss and its gradient are those of the call without it."""
    T, V = 24, 300
    logits, targets, w, prefix_ids, pi = ce_inputs(T, V, K, prefix, seed=K, dtype=dtype)
    targets[0], targets[1] = V - 1, 0  # vocab edges
    lr = logits.clone().requires_grad_(True)
    loss, next_token = impl()(lr, targets, w, prefix_ids, pi, grad_scale=0.37, next_token=True)
    assert next_token.dtype == torch.float32 and next_token.shape == (T,) and not next_token.requires_grad
    assert_close_rel(next_token, next_token_float64(logits, targets), TOL[torch.float32])
    (g,) = torch.autograd.grad(loss, lr, torch.ones(T))
    want_loss, want_g = run_ce(impl(), logits, targets, w, prefix_ids, pi, 0.37, torch.ones(T))
    assert torch.equal(loss, want_loss) and torch.equal(g, want_g)
    if K == 1 and not prefix:  # weight 1 on the next token alone: the loss is the next-token loss
        assert torch.equal(loss.detach(), next_token)


@pytest.mark.parametrize("kernel", [True, False], ids=["triton", "rows"])
def test_ce_e5m2_gradient_is_the_float64_gradient_scaled_and_rounded(kernel):
    """The FP8 head's variant: the same loss, and dlogits / grad_s written as e5m2 in the same pass:
    the float64 gradient of the record's formula divided by grad_s, rounded to nearest even; values
    past e5m2's range saturate at +-57344 instead of becoming inf."""
    T, V = 24, 300
    logits, targets, w, prefix_ids, pi = ce_inputs(T, V, 3, True, seed=5)
    want_loss, want_grad = ce_record_float64(logits, targets, w, prefix_ids, 0.25, grad_scale=0.37)
    for grad_s in (0.37 * 0.75 / 448, 1e-7):  # the head's scale, and one that overflows e5m2
        loss, next_token, g = tk.softcapped_ce_mtp_e5m2(logits, targets, w, prefix_ids, pi, 0.37, grad_s, kernel=kernel)
        assert g.dtype == torch.float8_e5m2 and g.shape == (T, V)
        assert_close_rel(loss, want_loss, TOL[torch.float32])
        assert_close_rel(next_token, next_token_float64(logits, targets), TOL[torch.float32])
        want = (want_grad / grad_s).clamp(-57344, 57344).to(torch.float8_e5m2)
        # fp32 against float64: a value on a rounding midpoint may take the other neighbour
        assert (g.float() != want.float()).double().mean() < 1e-3
        assert torch.isfinite(g.float()).all()
    assert (g.float().abs() == 57344).any()  # the second scale saturated


@pytest.mark.parametrize("impl", CE_IMPLS)
@pytest.mark.parametrize("grad_mul", [0.0, 300.0], ids=["fp32", "e5m2"])
def test_ce_duplicate_target_columns_sum_their_weights(impl, grad_mul):
    """Rows whose MTP targets and prefix token name the same column (a repeated token): that column's
    one-hot weight is the sum of all of them (2, 3 or 4 slots), the other columns have none; with
    weights whose sums round (0.4731 + 0.2917 + 0.1873)."""
    T, V = 16, 300
    logits, targets, _, prefix_ids, _ = ce_inputs(T, V, 3, True, seed=7)
    w, pi = torch.tensor([1.0, 0.4731, 0.2917]), torch.tensor(0.1873)
    targets[2:9] = 5  # rows 2-6 see column 5 two or three times among their targets
    prefix_ids[3:6] = 5
    prefix_ids[10] = targets[10]
    want_loss, want_grad = ce_record_float64(logits, targets, w, prefix_ids, 0.1873, grad_scale=0.37)
    if grad_mul:
        loss, _, g = tk.softcapped_ce_mtp_e5m2(logits, targets, w, prefix_ids, pi, 0.37, 1 / grad_mul,
                                               kernel=impl() is tk.softcapped_ce_mtp_triton)
        want = (want_grad * grad_mul).to(torch.float8_e5m2)
        assert (g.float() != want.float()).double().mean() < 1e-3
    else:
        loss, g = run_ce(impl(), logits, targets, w, prefix_ids, pi, 0.37, torch.ones(T))
        assert_close_rel(g, want_grad, TOL[torch.float32])
    assert_close_rel(loss, want_loss, TOL[torch.float32])


@pytest.mark.parametrize("impl", CE_ALL)
def test_ce_normaliser_counts_mtp_weights_past_the_end(impl):
    """S_t holds every MTP weight even where t + k >= T. The bracket (S p - hits) of a row sums over
    the vocabulary to S minus the weights of the targets that exist: 0 for the gradient of the loss,
    but 1.75 - 1.5 = 0.25 and 1.75 - 1 = 0.75 at the last two rows with weights (1, 0.5, 0.25). A valid
    prefix adds pi to both S and the hits, so it cancels."""
    T, V = 6, 300
    logits, targets, w, prefix_ids, pi = ce_inputs(T, V, 3)
    _, g = run_ce(impl(), logits, targets, w, prefix_ids, pi, 1.0, torch.ones(T))
    sigma = sigma_bf16_float64(logits)
    bracket = g.double() / ((23 / 7.5) * sigma * (1 - sigma))
    assert bracket.sum(1).tolist() == pytest.approx([0.0] * (T - 2) + [0.25, 0.75], abs=1e-4)


@pytest.mark.parametrize("impl", CE_ALL)
def test_ce_ignores_the_upstream_gradient(impl):
    """The gradient is grad_scale times the record's, whatever reaches the loss (a sum times 5, per-row
    values, zeros); grad_scale alone scales it."""
    T, V = 10, 300
    logits, targets, w, prefix_ids, pi = ce_inputs(T, V)
    args = (logits, targets, w, prefix_ids, pi)
    _, want = run_ce(impl(), *args, 0.37, torch.full((T,), 0.37))
    for upstream in (torch.full((T,), 5.0), torch.randn(T), torch.zeros(T)):
        _, got = run_ce(impl(), *args, 0.37, upstream)
        assert torch.equal(got, want)
    _, doubled = run_ce(impl(), *args, 0.74, torch.ones(T))
    assert_close_rel(doubled, 2 * want, 1e-6)


@pytest.mark.parametrize("impl", CE_ALL)
def test_ce_uses_sigma_rounded_to_bf16(impl):
    """z = 23 bf16(sigma): the loss is the rounded formula's to fp32 accuracy, far from the unrounded one."""
    T, V = 8, 300
    logits, targets, w, _, _ = ce_inputs(T, V, 1, prefix=False)
    loss, _ = run_ce(impl(), logits, targets, w, None, None, 1.0, torch.ones(T))
    z = 23 * torch.sigmoid((logits.double() + 5) / 7.5)
    unrounded = torch.logsumexp(z, 1) - z[torch.arange(T), targets]
    rounded, _ = ce_record_float64(logits, targets, w)
    assert (loss.double() - rounded).abs().max() < 1e-4
    assert (loss.double() - unrounded).abs().max() > 1e-3


@triton.jit
def _sigma_kernel(x_ptr, sigma_ptr, rounded_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + offs, mask=ok)
    tl.store(sigma_ptr + offs, tk._softcap_sigma(x), mask=ok)
    tl.store(rounded_ptr + offs, tk._round_to_bf16(x), mask=ok)


def test_kernel_sigma_and_bf16_rounding():
    """The kernel rounds to bf16 exactly as torch does (ties to even included); its sigma (the record's
    0.5 + 0.5 tanh(x/2)) and the CPU twin's (torch.sigmoid) both equal float64 math rounded to bf16 but
    for rare fp32 values at a rounding midpoint, which land one bf16 ulp away."""
    n = 1 << 18
    x = torch.randn(n) * 8
    # exact ties between two bf16 values (7 fraction bits): even below, odd below, and a non-tie
    x[:4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 0.75 + 2**-9, 1 + 2**-8 + 2**-20])
    sigma, rounded = nan_like((n,), torch.float32), nan_like((n,), torch.float32)
    _sigma_kernel[(triton.cdiv(n, 1 << 16),)](x, sigma, rounded, n, BLOCK=1 << 16)
    assert torch.equal(rounded, x.bfloat16().float())
    assert rounded[:4].tolist() == [1.0, 1 + 4 * 2**-8, 0.75, 1 + 2**-7]
    exact = sigma_bf16_float64(x).float()
    for got in (sigma, tk.softcap_sigma_bf16(x)):
        differ = got != exact
        assert differ.sum() <= 4, int(differ.sum())  # 1.6e-5 of the values at most
        assert ((got - exact)[differ].abs() <= 2**-8).all()  # one bf16 ulp of a sigma < 1


@pytest.mark.parametrize("impl", CE_IMPLS)
def test_ce_bf16_logits_and_weights_as_data(impl):
    T, V = 16, 513
    logits, targets, w, prefix_ids, pi = ce_inputs(T, V, dtype=torch.bfloat16)
    loss, g = run_ce(impl(), logits, targets, w, prefix_ids, pi, 1.0, torch.ones(T))
    want_loss, want_grad = ce_record_float64(logits, targets, w, prefix_ids, 0.25)
    assert_close_rel(loss, want_loss, TOL[torch.float32])  # the math is fp32 on bf16 inputs
    assert g.dtype == torch.bfloat16
    assert_close_rel(g, want_grad, TOL[torch.bfloat16])
    ref_loss, ref_g = run_ce(tk.softcapped_ce_mtp_reference, logits, targets, w, prefix_ids, pi, 1.0, torch.ones(T))
    assert_close_rel(loss, ref_loss, TOL[torch.float32])
    assert_close_rel(g, ref_g, TOL[torch.bfloat16])


@pytest.mark.parametrize("impl", CE_ALL)
def test_ce_short_sequence_and_errors(impl):
    logits, targets, w, prefix_ids, pi = ce_inputs(2, 40)
    loss, g = run_ce(impl(), logits, targets, w, prefix_ids, pi, 1.0, torch.ones(2))
    want_loss, want_grad = ce_record_float64(logits, targets, w, prefix_ids, 0.25)
    assert_close_rel(loss, want_loss, TOL[torch.float32])
    assert_close_rel(g, want_grad, TOL[torch.float32])
    bad = {
        "1 to 3": (logits, targets, torch.ones(4), None, None, 1.0),
        "targets must be": (logits, torch.tensor([1]), w, None, None, 1.0),
        "given together": (logits, targets, w, prefix_ids, None, 1.0),
        "prefix_ids must be": (logits, targets, w, prefix_ids.float(), pi, 1.0),
        "prefix_weight must be a 0-D": (logits, targets, w, prefix_ids, torch.tensor([0.25]), 1.0),
        "grad_scale must be": (logits, targets, w, None, None, float("inf")),
    }
    for message, (lg, tg_, w_, p, pw, gs) in bad.items():
        with pytest.raises(ValueError, match=message):
            impl()(lg, tg_, w_, p, pw, grad_scale=gs)


# The CPU head with its loss (the head's matmuls inside the loss's row blocks)

def head_inputs(T, D, V, dtype, seed=0):
    """x (T, D) and w (D, V) of small multiples of 1/2 and 1/4: every logit (a multiple of 1/8 below
    2^5) is exact in fp32 and bf16 whatever the summation order, so the float64 reference sees the
    op's logits and the same bf16-rounded sigma."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (T, D), generator=g).double() / 2
    w = torch.randint(-3, 4, (D, V), generator=g).double() / 4
    return x.to(dtype), w.to(dtype)


def head_grads(x, w, targets, weights, prefix_ids, prefix_weight, grad_scale, upstream):
    """(loss, dx, dw) of softcapped_ce_mtp_head_rows with `upstream` sent into the loss."""
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = tk.softcapped_ce_mtp_head_rows(xr, wr, targets, weights, prefix_ids, prefix_weight, grad_scale=grad_scale)
    dx, dw = torch.autograd.grad(loss, (xr, wr), upstream)
    return loss, dx, dw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [8, 1024])  # three blocks, the last one short; one block
@pytest.mark.parametrize("K,prefix", [(1, False), (3, True)])
def test_ce_head_rows_matches_the_float64_head_and_loss(K, prefix, rows, dtype, monkeypatch):
    """loss, dx = dlogits w^T and dw = x^T dlogits against float64 matmuls of the float64 record's
    gradient, over whole and partial row blocks."""
    monkeypatch.setattr(tk, "CE_CPU_HEAD_ROWS", rows)
    T, D, V = 21, 16, 300
    x, w = head_inputs(T, D, V, dtype, seed=K)
    _, targets, weights, prefix_ids, pi = ce_inputs(T, V, K, prefix, seed=K)
    loss, dx, dw = head_grads(x, w, targets, weights, prefix_ids, pi, 0.37, torch.randn(T))
    logits = x.double() @ w.double()
    want_loss, want_g = ce_record_float64(logits, targets, weights, prefix_ids, 0.25, grad_scale=0.37)
    assert loss.dtype == torch.float32 and dx.dtype == dtype and dw.dtype == dtype
    assert_close_rel(loss, want_loss, TOL[torch.float32])
    assert_close_rel(dx, want_g @ w.double().T, TOL[dtype])
    assert_close_rel(dw, x.double().T @ want_g, TOL[dtype])
    _, next_token = tk.softcapped_ce_mtp_head_rows(x, w, targets, weights, prefix_ids, pi, 0.37, next_token=True)
    assert not next_token.requires_grad
    assert_close_rel(next_token, next_token_float64(logits, targets), TOL[torch.float32])


def test_ce_head_rows_is_the_unfused_head_and_loss(monkeypatch):
    """Against softcapped_ce_mtp(x @ w) differentiated by autograd (the GPU's and the old CPU path),
    on data whose logits are not exact: the same loss and dx, and dw to fp32 rounding (its blocks are
    summed in another order)."""
    monkeypatch.setattr(tk, "CE_CPU_HEAD_ROWS", 16)
    T, D, V = 70, 32, 1000
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(T, D, generator=g), torch.randn(D, V, generator=g) * 0.5
    _, targets, weights, prefix_ids, pi = ce_inputs(T, V, 3, True, seed=3)
    loss, dx, dw = head_grads(x, w, targets, weights, prefix_ids, pi, 0.5, torch.ones(T))
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    want = tk.softcapped_ce_mtp_rows(xr @ wr, targets, weights, prefix_ids, pi, grad_scale=0.5)
    want.sum().backward()
    assert_close_rel(loss, want.detach(), 1e-6)
    assert_close_rel(dx, xr.grad, 1e-6)
    assert_close_rel(dw, wr.grad, 1e-6)


def test_ce_head_rows_ignores_the_upstream_gradient_and_errors():
    T, D, V = 10, 8, 50
    x, w = head_inputs(T, D, V, torch.float32)
    _, targets, weights, prefix_ids, pi = ce_inputs(T, V)
    args = (x, w, targets, weights, prefix_ids, pi)
    _, want_dx, want_dw = head_grads(*args, 0.37, torch.full((T,), 0.37))
    for upstream in (torch.full((T,), 5.0), torch.randn(T), torch.zeros(T)):
        _, dx, dw = head_grads(*args, 0.37, upstream)
        assert torch.equal(dx, want_dx) and torch.equal(dw, want_dw)
    _, dx2, dw2 = head_grads(*args, 0.74, torch.ones(T))
    assert_close_rel(dx2, 2 * want_dx, 1e-6)
    assert_close_rel(dw2, 2 * want_dw, 1e-6)
    bad = {
        "of one dtype": (x, w.bfloat16(), targets, weights, None, None),
        r"x \(T, D\) and w \(D, V\)": (x, w[:-1], targets, weights, None, None),
        "targets must be": (x, w, targets[:-1], weights, None, None),
        "given together": (x, w, targets, weights, prefix_ids, None),
    }
    for message, a in bad.items():
        with pytest.raises(ValueError, match=message):
            tk.softcapped_ce_mtp_head_rows(*a)


# ----------------------------------------------------------------------------------------------
# Transposes
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 96), (45, 130), (1, 70)])
def test_transpose_copy_and_add(shape, dtype):
    src = torch.randn(shape, dtype=dtype)
    dst = nan_like(shape[::-1], dtype)
    assert tk.transpose_copy_triton(src, dst) is dst
    assert torch.equal(dst, src.T)  # pure data movement: bit-exact
    base = torch.randn(shape[::-1], dtype=torch.float32)
    acc = base.clone()
    tk.transpose_add_triton(src, acc)  # bf16 gradient folded into an fp32 one
    assert_close_rel(acc, base + src.T.float(), TOL[torch.float32])
    acc_same = base.to(dtype)
    expected = acc_same.float() + src.T.float()
    tk.transpose_add_triton(src, acc_same)
    assert_close_rel(acc_same, expected, TOL[dtype])


def test_transpose_strided_and_errors():
    src = torch.randn(80, 50)[::2]  # (40, 50), row stride 100
    dst = nan_like((50, 40), torch.float32)
    tk.transpose_copy_triton(src, dst)
    assert torch.equal(dst, src.T)
    with pytest.raises(ValueError, match="dst"):
        tk.transpose_copy_triton(src, torch.empty(40, 50))


# ----------------------------------------------------------------------------------------------
# Custom ops: schema, fake tensors, autograd registration, torch.compile
# ----------------------------------------------------------------------------------------------


def _opcheck_cases():
    A = torch.randn(20, 36)
    x = torch.randn(9, 16, requires_grad=True)
    wu, wd = torch.randn(24, 16, requires_grad=True), torch.randn(24, 16, requires_grad=True)
    post = torch.relu(x.detach() @ wu.detach().T).square()
    logits = torch.randn(8, 50, requires_grad=True)
    return [
        ("relu2_mlp_fwd", (x, wu, wd, True)),
        ("relu2_mlp_fwd", (x, wu, wd, False)),
        ("relu2_mlp_bwd", (torch.randn(9, 16), x.detach(), wu.detach(), wd.detach(), post, True)),
        ("relu2_mlp_bwd", (torch.randn(9, 16), x.detach(), wu.detach(), wd.detach(), post, False)),
        ("softcapped_ce_mtp_fwd", (logits, torch.randint(0, 50, (8,)), torch.tensor([1.0, 0.5]),
                                   torch.randint(-1, 50, (8,)), torch.tensor(0.25), 0.5)),
        ("softcapped_ce_mtp_fwd", (logits, torch.randint(0, 50, (8,)), torch.tensor([1.0]), None, None, 1.0)),
        ("softcapped_ce_mtp_fwd", (logits.detach(), torch.randint(0, 50, (8,)), torch.tensor([1.0]), None, None, 1.0, 4.0)),
        ("softcapped_ce_mtp_rows", (torch.randn(40, 50, requires_grad=True), torch.randint(0, 50, (40,)),
                                    torch.tensor([1.0, 0.5, 0.25]), torch.randint(-1, 50, (40,)), torch.tensor(0.25),
                                    0.25)),
        ("softcapped_ce_mtp_rows", (torch.randn(40, 50, requires_grad=True), torch.randint(0, 50, (40,)),
                                    torch.tensor([1.0, 0.5]), None, None, 0.25)),
        ("softcapped_ce_mtp_head_rows", (torch.randn(40, 16, requires_grad=True), torch.randn(16, 50, requires_grad=True),
                                         torch.randint(0, 50, (40,)), torch.tensor([1.0, 0.5, 0.25]),
                                         torch.randint(-1, 50, (40,)), torch.tensor(0.25), 0.25)),
        ("softcapped_ce_mtp_head_rows", (torch.randn(40, 16, requires_grad=True), torch.randn(16, 50, requires_grad=True),
                                         torch.randint(0, 50, (40,)), torch.tensor([1.0]), None, None, 1.0)),
        ("transpose_copy", (A, torch.empty(36, 20))),
        ("transpose_add", (A, torch.randn(36, 20))),
    ]


@pytest.mark.parametrize("name,args", _opcheck_cases(),
                         ids=[c[0] + ("" if c[1][-1] is not False else "_torch") for c in _opcheck_cases()])
def test_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.speedrun, name).default, args)


def test_ops_are_opaque_under_torch_compile():
    def step(x, wu, wd, logits, targets, w, prefix_ids, pi):
        y = tk.relu2_mlp_triton(x, wu, wd)
        return y.sum() + tk.softcapped_ce_mtp_triton(logits, targets, w, prefix_ids, pi, grad_scale=0.5).sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    x, wu, wd = torch.randn(8, 16), torch.randn(32, 16), torch.randn(32, 16)
    logits, targets, prefix_ids = torch.randn(8, 40), torch.randint(0, 40, (8,)), torch.randint(-1, 40, (8,))
    for w, pi in ((torch.tensor([1.0, 0.5]), torch.tensor(0.25)), (torch.tensor([1.0, 0.25]), torch.tensor(0.1))):
        # new weights: same graph
        assert_close_rel(compiled(x, wu, wd, logits, targets, w, prefix_ids, pi),
                         step(x, wu, wd, logits, targets, w, prefix_ids, pi), TOL[torch.float32])


# ----------------------------------------------------------------------------------------------
# Hopper compilation (no GPU needed: triton compiles to sm_90 PTX/cubin with its bundled ptxas)
# ----------------------------------------------------------------------------------------------

_HOPPER_COMPILE = r'''
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton_kernels as tk

def compile_sm90(fn, args, constexprs, num_warps, num_stages):
    # Mimic the JIT's launch-time specialization: integer args equal to 1 (unit strides) become
    # constants and pointers/ints divisible by 16 get the divisibility hint that enables
    # vectorized, pipelined loads.
    sig, consts, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        kind, value = args[name]
        if kind == "i32" and value == 1:
            sig[name] = "constexpr"
            consts[name] = 1
            continue
        sig[name] = kind
        if kind.startswith("*") or (kind == "i32" and value % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    return dict(shared=k.metadata.shared, stages=num_stages, wgmma=k.asm["ptx"].count("wgmma.mma_async"),
                async_copy=k.asm["ttgir"].count("async_copy_global_to_local"),
                tanh_approx=k.asm["ptx"].count("tanh.approx.f32"))

bf = "*bf16"
ptr = lambda kind=bf: (kind, 0)
i32 = lambda v: ("i32", v)
res = {}
# XTX on the MLP bank as Polar Express sees it: 3 x (3072 x 768) -> 3 x 768 x 768, and the
# batched ba_plus_cAA on the attention banks (8 x 768 x 768).
sym = dict(x_ptr=ptr(), y_ptr=ptr(), z_ptr=ptr(), out_ptr=ptr(), N=i32(768), K=i32(3072), n_batches=i32(3),
           sxb=i32(3072 * 768), sxm=i32(1), sxk=i32(768), syb=i32(3072 * 768), syk=i32(768), syn=i32(1),
           szb=i32(3072 * 768), szm=i32(768), szn=i32(1), sob=i32(768 * 768), som=i32(768), son=i32(1),
           alpha=("fp32", 0), beta=("fp32", 0))
res["xtx_64"] = compile_sm90(tk._sym_mm_kernel, sym, dict(HAS_Z=False, FP64=False, PREC="tf32", BLOCK=64, BLOCK_K=64), 4, 4)
sym.update(K=i32(768), n_batches=i32(8), sxm=i32(768), sxk=i32(1), syk=i32(768), syn=i32(1))
res["aa_128"] = compile_sm90(tk._sym_mm_kernel, sym, dict(HAS_Z=True, FP64=False, PREC="tf32", BLOCK=128, BLOCK_K=64), 8, 4)
mm = dict(a_ptr=ptr(), b_ptr=ptr(), c_ptr=ptr(), aux_ptr=ptr(), M=i32(49152), N=i32(3072), K=i32(768),
          sam=i32(768), sak=i32(1), sbk=i32(1), sbn=i32(768), scm=i32(3072), scn=i32(1), sxm=i32(3072), sxn=i32(1))
big = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8)
res["mlp_fwd"] = compile_sm90(tk._mm_epilogue_kernel, mm, dict(EPILOGUE=1, FP64=False, PREC="tf32", **big), 8, 3)
res["mlp_bwd"] = compile_sm90(tk._mm_epilogue_kernel, mm, dict(EPILOGUE=2, FP64=False, PREC="tf32", **big), 8, 3)
f8 = "*fp8e4nv"
up = dict(a_ptr=ptr(f8), b_ptr=ptr(f8), post_ptr=ptr(), q_ptr=ptr(f8), amax_ptr=ptr("*fp32"), dequant_ptr=ptr("*fp32"),
          act_scale_ptr=ptr("*fp32"), M=i32(49152), N=i32(3072), K=i32(768), sam=i32(768), sak=i32(1), sbk=i32(1),
          sbn=i32(768), spm=i32(3072), spn=i32(1), sqm=i32(3072), sqn=i32(1))
res["mlp_fp8_up"] = compile_sm90(tk._fp8_relu2_kernel, up, dict(FAST_ACC=True, BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8), 8, 3)
res["mlp_fp8_up_precise"] = compile_sm90(tk._fp8_relu2_kernel, up, dict(FAST_ACC=False, BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8), 8, 3)
ce = dict(logits_ptr=ptr(), targets_ptr=ptr("*i64"), weights_ptr=ptr("*fp32"), prefix_ids_ptr=ptr("*i64"),
          prefix_weight_ptr=ptr("*fp32"), loss_ptr=ptr("*fp32"), next_token_ptr=ptr("*fp32"), grad_ptr=ptr(),
          T=i32(49152), V=i32(50304), s_lt=i32(50304), s_gt=i32(50304), grad_scale=("fp32", 0), grad_mul=("fp32", 0))
ce_consts = dict(K=3, HAS_PREFIX=True, J_POW2=4, BLOCK_V=4096, GRAD_E5M2=False, FAST_TANH=False)
res["ce"] = compile_sm90(tk._ce_mtp_kernel, ce, ce_consts, 8, 3)
# The softcap's tanh as one PTX tanh.approx.f32 (the kernel-tuning check times it against tanh)
res["ce_fast_tanh"] = compile_sm90(tk._ce_mtp_kernel, ce, {**ce_consts, "FAST_TANH": True}, 8, 3)
ce.update(grad_ptr=ptr("*fp8e5"))
res["ce_e5m2"] = compile_sm90(tk._ce_mtp_kernel, ce, {**ce_consts, "GRAD_E5M2": True}, 8, 3)
tr = dict(src_ptr=ptr(), dst_ptr=ptr("*fp32"), M=i32(50304), N=i32(768), ssm=i32(768), ssn=i32(1), sdn=i32(50304), sdm=i32(1))
res["transpose_add"] = compile_sm90(tk._transpose_kernel, tr, dict(ADD=True, BLOCK_M=64, BLOCK_N=64), 4, 1)
print(json.dumps(res))
'''


@pytest.mark.slow
def test_kernels_compile_for_hopper():
    """The kernels compile for sm_90 at the speedrun configs, with wgmma and pipelined loads."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _HOPPER_COMPILE], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("triton's bundled ptxas is missing")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("xtx_64", "aa_128", "mlp_fwd", "mlp_bwd", "mlp_fp8_up", "mlp_fp8_up_precise"):
        assert res[name]["wgmma"] > 0, (name, res[name])  # Hopper tensor-core instructions
        # K loop software-pipelined: both operand tiles prefetched (stages - 1) iterations ahead
        assert res[name]["async_copy"] >= 2 * (res[name]["stages"] - 1), (name, res[name])
        assert res[name]["shared"] <= 227 * 1024, (name, res[name])  # fits H100 shared memory
    for name in ("ce", "ce_e5m2", "ce_fast_tanh"):
        assert res[name]["shared"] <= 227 * 1024, (name, res[name])
    assert res["ce_fast_tanh"]["tanh_approx"] > 0 and res["ce"]["tanh_approx"] == 0, (res["ce"], res["ce_fast_tanh"])


# ----------------------------------------------------------------------------------------------
# Which of the Triton kernel and torch an H100 runs, per shape
# ----------------------------------------------------------------------------------------------


def test_kernel_choice_takes_the_faster_measured_one_on_each_measured_gpu(monkeypatch):
    names = {"H100": "NVIDIA H100 80GB HBM3", "H200": "NVIDIA H200"}
    assert set(tk.KERNEL_TIMES) == set(names)
    for gpu, table in tk.KERNEL_TIMES.items():
        for (name, *shape), (triton_ms, torch_ms) in table.items():
            want = "torch" if torch_ms < triton_ms else "triton"
            assert tk.kernel_choice(name, tuple(shape), names[gpu]) == want
            assert tk.kernel_choice(name, tuple(shape), "NVIDIA A100-SXM4-80GB") == "triton"  # never measured
    h100, h200 = names["H100"], names["H200"]
    assert tk.kernel_choice("XXT", (8, 768, 768), h100) == "torch"        # 0.017 ms against 0.034
    assert tk.kernel_choice("ba_plus_cAA", (8, 768, 768), h100) == "triton"  # 0.023 against 0.028
    assert tk.kernel_choice("ba_plus_cAA", (8, 768, 768), h200) == "torch"   # the H200: 0.026 against 0.031
    assert tk.kernel_choice("XTX", (24, 3072, 768), h200) == "triton"     # 0.098 against 0.123
    assert tk.kernel_choice("XXT", (8, 256, 768), h100) == "triton"       # not measured on the H100: the kernel
    assert tk.kernel_choice("XXT", (5, 768, 768), h200) == "triton"       # not measured: the kernel
    assert tk.kernel_choice("XXT", (768, 3072), h100) == "triton"         # a 2-D A is batch 1
    monkeypatch.setattr(tk, "USE_KERNEL_TABLE", False)
    assert tk.kernel_choice("XXT", (8, 768, 768), h100) == "triton"


def test_gpu_name_is_read_at_trace_time():
    """The choice is made while tracing a compiled NorMuon update: reading the GPU's name must not
    break the graph."""
    compiled = torch.compile(lambda x: x + len(tk._gpu_name(0)), backend="eager", fullgraph=True)
    assert compiled(torch.zeros(2)).shape == (2,)
    assert torch.compile(lambda x: x + len(tk.gpu_name_of(x)), backend="eager", fullgraph=True)(torch.zeros(2)).tolist() == [0, 0]


def test_cuda_grid_size_is_read_at_trace_time(monkeypatch):
    """XXT's launch is traced into the compiled NorMuon update on CUDA: its tiles and persistent grid read
    the GPU's SM count, which must be a trace-time constant (a driver query does not trace: it would
    break the fullgraph update). The query is stood in for by one that dynamo cannot trace either."""
    def device_properties(index):
        open(os.devnull).close()  # file I/O: a graph break wherever dynamo traces into it
        return types.SimpleNamespace(multi_processor_count=132)

    monkeypatch.setattr(torch.cuda, "get_device_properties", device_properties)
    cuda = torch.device("cuda", 0)
    tk._cuda_sm_count_cached.cache_clear()
    try:
        fn = torch.compile(lambda x: x + tk._num_programs(cuda, 1000) + tk._sym_config(768, 24, cuda)["BLOCK"],
                           backend="eager", fullgraph=True)
        assert fn(torch.zeros(2)).tolist() == [132 + 128] * 2  # 24 banks x 21 tiles of 128 fill 132 SMs
    finally:
        tk._cuda_sm_count_cached.cache_clear()  # (a GPU machine's own count next)


def test_the_trace_time_mark_is_torchs_own_and_importing_takes_no_dynamo():
    """_constant_at_trace_time sets what torch.compiler.assume_constant_result sets (the test above checks
    what dynamo does with it), without importing torch._dynamo: a process that imports train_gpt and stops
    before its first op (a flag error, --dry-run) does not pay dynamo's import (a custom op's first call
    imports it)."""
    def ours():
        return 1

    def torchs():
        return 1

    tk._constant_at_trace_time(ours)
    torch.compiler.assume_constant_result(torchs)
    assert vars(ours) == vars(torchs) and vars(torchs)
    root = os.path.dirname(os.path.abspath(tk.__file__))
    code = "import sys, train_gpt; print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_softcap_log_probs_is_the_reference_bit_for_bit(dtype, threads):
    """The evaluation's blocked CPU path equals log_softmax(softcap(logits)) exactly: row counts below,
    at and past a block (CE_CPU_ROWS), both compute dtypes, one thread or several; fp32 logits are not
    written to (the blocks work in place on copies)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(7)
        for rows in (1, tk.CE_CPU_ROWS - 1, tk.CE_CPU_ROWS, 3 * tk.CE_CPU_ROWS + 5):
            logits = (8 * torch.randn(rows, 50304, generator=g)).to(dtype)
            before = logits.clone()
            got = tk.softcap_log_probs(logits)
            want = torch.log_softmax(tk.softcap(logits), dim=-1)
            assert got.dtype == torch.float32 and torch.equal(got, want), (dtype, rows)
            assert torch.equal(logits, before)
            assert got.exp().sum(1).sub(1).abs().max() < 1e-4  # probabilities, not some other row-wise map
    finally:
        torch.set_num_threads(old)
