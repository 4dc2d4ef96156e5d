"""The float8 matmul op: quantisation semantics, gradients, registration and the cuBLAS layout rules.

References are computed independently: quantise with a plain float64/float32 cast, dequantise, and
multiply in float64. On this CPU-only machine the op runs its emulation, so the layout checker is what
guarantees the tensors it would hand to cuBLAS are legal there.
"""
import pytest
import torch

import train_gpt as tg

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def dequant(t: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Float64 value of t after an fp8 round trip; scales are powers of two so t/scale is exact."""
    return (t.double() / scale).to(dtype).double() * scale


def make_inputs(M=48, K=64, N=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (0.05 * torch.randn(K, N, generator=g)).bfloat16()
    dy = (0.01 * torch.randn(M, N, generator=g)).bfloat16()
    return x, w, dy


# Power-of-two scales: t / scale is exact in bf16, so the op and the reference quantise identically.
XS, WS, GS = 2.0 ** -5, 2.0 ** -10, 2.0 ** -12


def test_forward_equals_dequantized_float64_matmul():
    x, w, _ = make_inputs()
    y = tg.fp8_matmul(x, w, XS, WS, GS)
    assert y.dtype == torch.bfloat16 and y.shape == (48, 80)
    ref = dequant(x, XS, E4M3) @ dequant(w, WS, E4M3)
    # only the final bf16 rounding separates them
    torch.testing.assert_close(y.double(), ref, rtol=2 ** -8, atol=1e-6)
    # and the whole thing is a matmul up to float8 quantisation error (3 mantissa bits)
    exact = x.double() @ w.double()
    assert (y.double() - exact).norm() / exact.norm() < 0.06


def test_gradients_equal_dequantized_float64_references():
    x, w, dy = make_inputs()
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = tg.fp8_matmul(x, w, XS, WS, GS)
    y.backward(dy)
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16  # cast to the parameter dtype
    g = dequant(dy, GS, E5M2)
    torch.testing.assert_close(x.grad.double(), g @ dequant(w, WS, E4M3).T, rtol=2 ** -8, atol=1e-8)
    torch.testing.assert_close(w.grad.double(), dequant(x, XS, E4M3).T @ g, rtol=2 ** -8, atol=1e-8)
    # the backward op itself returns grad_w in fp32
    x_f8 = (x.detach() / XS).to(E4M3)
    w_f8 = (w.detach().T / WS).to(E4M3).contiguous().T
    gx, gw = tg.fp8_mm_backward(dy, x_f8, w_f8, XS, WS, GS)
    assert gx.dtype == torch.bfloat16 and gw.dtype == torch.float32
    torch.testing.assert_close(gw.double(), dequant(x, XS, E4M3).T @ g, rtol=1e-6, atol=1e-9)


def test_head_scales_keep_realistic_values_in_range():
    """With the LM head's static scales, rms-normed activations and head-sized weights survive."""
    g = torch.Generator().manual_seed(1)
    x = tg.norm(torch.randn(64, 128, generator=g)).bfloat16()
    w = (0.02 * torch.randn(128, 256, generator=g)).bfloat16()
    y = tg.fp8_matmul(x, w, tg.FP8_HEAD_X_SCALE, tg.FP8_HEAD_W_SCALE, tg.FP8_HEAD_GRAD_SCALE)
    exact = x.double() @ w.double()
    assert (y.double() - exact).norm() / exact.norm() < 0.06


def test_emulation_matches_torch_scaled_mm_on_cpu():
    """An independent implementation of the same semantics: torch._scaled_mm runs on the CPU here."""
    x, w, dy = make_inputs(seed=2)
    x_f8 = (x / XS).to(E4M3)
    w_f8 = (w.T / WS).to(E4M3).contiguous().T
    sx, sw = torch.tensor(XS), torch.tensor(WS)
    try:
        ref = torch._scaled_mm(x_f8, w_f8, sx, sw, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as e:  # pragma: no cover - depends on the torch build
        pytest.skip(f"torch._scaled_mm unavailable on CPU: {e}")
    y, _, _ = tg.fp8_mm(x, w, XS, WS, GS)
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -8, atol=1e-6)


def test_opcheck_registrations():
    x, w, dy = make_inputs(M=32, K=32, N=48)
    # opcheck's harness cannot handle every float8 tensor (its aot_dispatch test sums the forward's
    # float8 outputs, its schema test compares the backward's float8 inputs): those two are covered
    # by compiling through AOTAutograd below.
    torch.library.opcheck(tg.fp8_mm, (x.requires_grad_(), w.requires_grad_(), XS, WS, GS),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    x_f8 = (x.detach() / XS).to(E4M3)
    w_f8 = (w.detach().T / WS).to(E4M3).contiguous().T
    torch.library.opcheck(tg.fp8_mm_backward, (dy[:, :48], x_f8, w_f8, XS, WS, GS),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_aot_autograd_compile_matches_eager():
    x, w, dy = make_inputs(M=32, K=32, N=48, seed=3)

    def f(a, b):
        return tg.fp8_matmul(a, b, XS, WS, GS)

    grads = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(a, b)
        y.backward(dy)
        grads.append((y.detach(), a.grad, b.grad))
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


# ---- the cuBLAS rules, checked directly -------------------------------------------------------


def _ok():
    a = torch.zeros(32, 64).to(E4M3)                    # row-major (M, K)
    b = torch.zeros(48, 64).to(E4M3).T                  # column-major (K, N)
    return a, b, torch.tensor(1.0), torch.tensor(1.0)


def test_checker_accepts_the_legal_layout():
    tg.check_scaled_mm_args(*_ok())


@pytest.mark.parametrize("case, message", [
    ("a_column_major", "first operand must be row-major"),
    ("b_row_major", "second operand must be column-major"),
    ("m_not_16", "multiples of 16"),
    ("k_not_16", "multiples of 16"),
    ("n_not_16", "multiples of 16"),
    ("both_e5m2", "e5m2 x e5m2"),
    ("bf16_operand", "float8"),
    ("scale_bf16", "scale_a must be a single float32"),
    ("scale_vector", "scale_b must be a single float32"),
    ("inner_mismatch", "inner dimensions"),
    ("three_d", "2-D"),
    ("scale_a_offset_4_bytes", "scale_a sits at byte offset 4 .* not 16-byte aligned"),
    ("scale_b_offset_12_bytes", "scale_b sits at byte offset 12 .* not 16-byte aligned"),
])
def test_checker_rejects(case, message):
    a, b, sa, sb = _ok()
    if case == "a_column_major":
        a = torch.zeros(64, 32).to(E4M3).T
    elif case == "b_row_major":
        b = torch.zeros(64, 48).to(E4M3)
    elif case == "m_not_16":
        a = torch.zeros(40, 64).to(E4M3)
    elif case == "k_not_16":
        a, b = torch.zeros(32, 72).to(E4M3), torch.zeros(48, 72).to(E4M3).T
    elif case == "n_not_16":
        b = torch.zeros(56, 64).to(E4M3).T
    elif case == "both_e5m2":
        a, b = a.to(E5M2), b.to(E5M2)
    elif case == "bf16_operand":
        a = torch.zeros(32, 64, dtype=torch.bfloat16)
    elif case == "scale_bf16":
        sa = sa.bfloat16()
    elif case == "scale_vector":
        sb = torch.ones(48)
    elif case == "inner_mismatch":
        b = torch.zeros(48, 80).to(E4M3).T
    elif case == "three_d":
        a = torch.zeros(2, 32, 64).to(E4M3)
    elif case == "scale_a_offset_4_bytes":  # a 0-d view of a per-layer vector: what failed on the H100
        sa = torch.ones(4)[1]
    elif case == "scale_b_offset_12_bytes":
        sb = torch.ones(4)[3]
    with pytest.raises(ValueError, match=message):
        tg.check_scaled_mm_args(a, b, sa, sb)


def test_op_rejects_dims_cublas_cannot_take():
    x, w, _ = make_inputs(M=40, K=64, N=80)
    with pytest.raises(ValueError, match="multiples of 16"):
        tg.fp8_matmul(x, w, XS, WS, GS)


# ---- the op inside the model -------------------------------------------------------------------


def _head_run(fp8: bool):
    # a small vocabulary: the float8 matmuls' CPU emulation is slow at 50k columns
    args = tg.parse_args(["--preset", "test", "--fp8", str(fp8), "--vocab_size", "1000", "--padded_vocab_size", "1024"])
    torch.manual_seed(0)
    model = tg.GPT(args)
    model.quantize_fp8(bootstrap=True)  # read only where the head and MLPs run in FP8
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (129,), generator=g)
    cu = torch.tensor([0, 60, 128, 128], dtype=torch.int32)
    loss, _ = model(tokens[:-1], tokens[1:], cu, tg.bigram_hash(tokens[:-1], args.ngram_rows),
                    mtp_weights=torch.tensor([1.0, 0.5]), loss_scale=1 / 128)
    loss.backward()
    return loss.item(), model.lm_head.grad.float(), model.mlp_bank.grad.float()


def test_model_training_head_uses_fp8_where_supported(monkeypatch):
    """Pretend the CPU has FP8 tensor cores: the head then goes through the FP8 head op (its float8
    matmuls emulated on the CPU) with the static head scales; --fp8 false keeps the bf16 head. (The MLPs switch to
    FP8 with it; their down-projections are zero at init, so they change little here.)"""
    calls = []
    real = tg.fp8_head_loss
    monkeypatch.setattr(tg, "fp8_head_loss", lambda *a: calls.append(a[8:]) or real(*a))
    loss16, head16, mlp16 = _head_run(fp8=True)   # CPU: no FP8 tensor cores, bf16 head
    assert calls == []
    monkeypatch.setattr(tg, "_native_fp8", lambda device: True)
    loss8, head8, mlp8 = _head_run(fp8=True)
    assert calls == [(tg.FP8_HEAD_X_SCALE, tg.FP8_HEAD_W_SCALE, tg.FP8_HEAD_GRAD_SCALE / 128, 1 / 128)]
    assert loss8 != loss16 and loss8 == pytest.approx(loss16, rel=1e-3)
    assert (head8 - head16).norm() / head16.norm() < 0.1
    assert (mlp8 - mlp16).norm() / mlp16.norm() < 0.1
    calls.clear()
    assert _head_run(fp8=False)[0] == loss16 and calls == []


# ---- the FP8 LM head with the loss: e5m2 gradient from the loss kernel, precise backward ----------


def _head_inputs(T=64, K=32, N=96, seed=7):
    g = torch.Generator().manual_seed(seed)
    x = tg.norm(torch.randn(T, K, generator=g)).bfloat16()
    w = (0.3 * torch.randn(K, N, generator=g)).bfloat16()
    targets = torch.randint(0, N, (T,), generator=g)
    prefix = torch.randint(-1, N, (T,), generator=g)
    return x, w, targets, torch.tensor([1.0, 0.5, 0.25]), prefix, torch.tensor(0.25)


def head_loss(x, w, targets, mtp, prefix, pi, xs, ws, gs, grad_scale):
    """fp8_head_loss on x and w quantised at the given scales (the model passes fp8_head_input(x) and
    its buffer from fp8_head_weight(lm_head), at the FP8_HEAD_* scales): (loss, next-token loss, e5m2
    gradient)."""
    x_f8 = tg._quantize_fp8(x.detach(), xs, E4M3)
    w_f8 = tg._quantize_fp8(w.detach().T, ws, E4M3).T
    return tg.fp8_head_loss(x, w, x_f8, w_f8, targets, mtp, prefix, pi, xs, ws, gs, grad_scale)


def test_fp8_head_loss_against_float64_references():
    """Loss of the bf16 logits of the dequantised float8 product; the e5m2 gradient is the float64
    reference gradient / grad_s rounded to e5m2; dx and dw are float64 products of the float8 operands."""
    x, w, targets, mtp, prefix, pi = _head_inputs()
    grad_scale = 1 / 64
    gs = tg.FP8_HEAD_GRAD_SCALE * grad_scale
    xs, ws = tg.FP8_HEAD_X_SCALE, tg.FP8_HEAD_W_SCALE
    a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss, next_token, g_f8 = head_loss(a, b, targets, mtp, prefix, pi, xs, ws, gs, grad_scale)
    (loss.sum() * grad_scale).backward()
    assert g_f8.dtype == E5M2 and g_f8.shape == (x.shape[0], w.shape[1])
    # quantised as the record does: t / scale in bf16, then cast to e4m3
    xq, wq = (x / xs).to(E4M3).double() * xs, (w / ws).to(E4M3).double() * ws
    logits = (xq @ wq).bfloat16().double()  # the forward's bf16 output
    import triton_kernels as tk
    ref_loss, ref_next_token, ref_g = tk.softcapped_ce_mtp_e5m2_reference(logits, targets, mtp.double(), prefix,
                                                                          pi.double(), grad_scale, gs)
    torch.testing.assert_close(loss.double(), ref_loss.double(), rtol=1e-5, atol=1e-5)
    # the next-token loss: evaluation's log-softmax of the training z = 23 bf16(sigma), in float64
    z = 23 * (torch.sigmoid((logits + 5) / 7.5).float().bfloat16().double())
    want = -torch.log_softmax(z, dim=1).gather(1, targets[:, None]).squeeze(1)
    assert next_token.dtype == torch.float32 and not next_token.requires_grad
    torch.testing.assert_close(next_token.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref_next_token.double(), want, rtol=1e-5, atol=1e-5)
    differ = (g_f8.float() != ref_g.float()).float().mean()
    assert differ < 0.01  # fp32 against float64 math: a rare neighbouring e5m2 value
    g = g_f8.double() * gs
    torch.testing.assert_close(a.grad.double(), (g @ wq.T).bfloat16().double(), rtol=2 ** -7, atol=1e-7)
    torch.testing.assert_close(b.grad.double(), (xq.T @ g).bfloat16().double(), rtol=2 ** -7, atol=1e-7)


def test_fp8_head_backward_runs_without_fast_accumulation(monkeypatch):
    """Record #89: the forward product uses fast accumulation, dx and dw do not."""
    seen = []
    real = tg._scaled_matmul
    monkeypatch.setattr(tg, "_scaled_matmul", lambda a, b, sa, sb, out_dtype, fast_accum:
                        seen.append((tuple(a.shape), tuple(b.shape), out_dtype, fast_accum)) or
                        real(a, b, sa, sb, out_dtype, fast_accum))
    x, w, targets, mtp, prefix, pi = _head_inputs(T=48, K=32, N=80)
    a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = head_loss(a, b, targets, mtp, prefix, pi, 0.1, 0.01, 1e-4, 1.0)[0]
    loss.sum().backward()
    assert seen == [((48, 32), (32, 80), torch.bfloat16, True),    # logits
                    ((48, 80), (80, 32), torch.bfloat16, False),   # dx = dlogits @ w^T
                    ((32, 48), (48, 80), torch.float32, False)]    # dw = x^T @ dlogits


def test_fp8_head_gradient_saturates_instead_of_overflowing():
    """A gradient scale far too small for the gradient: e5m2 values saturate at +-57344, never inf."""
    x, w, targets, mtp, prefix, pi = _head_inputs()
    _, _, g_f8 = head_loss(x, w, targets, mtp, prefix, pi, 0.1, 0.01, 1e-9, 1.0)
    g = g_f8.float()
    assert torch.isfinite(g).all() and g.abs().max() == 57344


def test_fp8_head_loss_registrations():
    x, w, targets, mtp, prefix, pi = _head_inputs(T=32, K=32, N=48)
    x_f8, w_f8 = tg._quantize_fp8(x, 0.1, E4M3), tg._quantize_fp8(w.T, 0.01, E4M3).T
    torch.library.opcheck(tg.fp8_head_loss, (x.requires_grad_(), w.requires_grad_(), x_f8, w_f8, targets, mtp, prefix,
                                             pi, 0.1, 0.01, 1e-4, 1.0),
                          test_utils=("test_autograd_registration", "test_faketensor"))

    def f(a, b):  # the float8 operands come in as the model's: x_f8 row-major, w_f8 a transposed buffer
        return tg.fp8_head_loss(a, b, x_f8, w_f8, targets, mtp, prefix, pi, 0.1, 0.01, 1e-4, 1.0)[0].sum()

    grads = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        a, b = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        fn(a, b).backward()
        grads.append((a.grad, b.grad))
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


# ---- the FP8 MLP (record #89: current-scaled up-projection, delayed-scaled down-projection) ------


def e4m3(t: torch.Tensor) -> torch.Tensor:
    """Float64 value of t rounded to float8_e4m3fn (t within +-448)."""
    return t.to(E4M3).double()


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def fp8_mlp_emulation(x, w_up, w_down, act_scale: float):
    """The FP8 MLP written out in float64 from its definition (record #89's FP8 MLP), bootstrap W2
    scale. Returns (y, post, amax of post)."""
    x, w_up, w_down = x.double(), w_up.double(), w_down.double()
    ax = x.abs().max()
    x_q = e4m3(x * 448 / ax)
    s1 = bf16(w_up.abs().max() / 448)          # the scale is a bf16 number ...
    w_up_q = e4m3(bf16(w_up / s1))             # ... and W1 / s1 is taken in bf16
    pre = bf16((x_q @ w_up_q.T) * (s1 * ax / 448))
    post = bf16(torch.relu(pre) ** 2)
    post_q = e4m3((post / act_scale).clamp(max=448))
    s2 = w_down.abs().max() / 448
    w_down_q = e4m3((w_down / s2).clamp(-448, 448))
    return (post_q @ w_down_q) * (act_scale * s2), post, post.max()


def mlp_inputs(T=48, D=64, H=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = tg.norm(torch.randn(T, D, generator=g)).bfloat16()
    w_up = (torch.rand(H, D, generator=g) * 2 - 1).mul(D ** -0.5).bfloat16()
    w_down = (0.05 * torch.randn(H, D, generator=g)).bfloat16()
    dy = torch.randn(T, D, generator=g).bfloat16()
    return x, w_up, w_down, dy


def mlp_op_operands(state: tg.FP8MLPState, x: torch.Tensor, layer: int = 0) -> tuple:
    """fp8_mlp's arguments after (x, w_up, w_down), as FP8MLPState.mlp makes them (record #89's current
    scaling of x)."""
    amax_x = x.abs().amax().float()
    x_f8 = (x.float() * (448 / amax_x)).to(E4M3)
    return (x_f8, state.up_f8[layer], state.up_scale[layer, 0] * amax_x / 448, state.down_f8_t[layer],
            state.down_scale[layer, 0], state.act_scale[layer, 0])


def fp8_state(w_up, w_down) -> tg.FP8MLPState:
    state = tg.FP8MLPState(1, *w_up.shape)
    state.quantize(torch.stack([w_up, w_down]), bootstrap=True)
    return state


@pytest.mark.parametrize("headroom", [1.8, 0.5])  # the delayed scale's headroom, and one that clips post
def test_fp8_mlp_forward_backward_match_float64_emulation(headroom):
    x, w_up, w_down, dy = mlp_inputs()
    _, post64, amax64 = fp8_mlp_emulation(x, w_up, w_down, 1.0)
    act = float(amax64) * headroom / 448
    y_ref, post_ref, _ = fp8_mlp_emulation(x, w_up, w_down, act)
    state = fp8_state(w_up, w_down)
    state.act_scale[:, 0] = act
    x_, w_up_, w_down_ = (t.clone().requires_grad_(True) for t in (x, w_up, w_down))
    y = state.mlp(0, x_, w_up_, w_down_)[0]
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    # fp32 sums in another order (an occasional bf16 flip of pre) and the final bf16 rounding
    assert (y.double() - y_ref).abs().max() <= 2 ** -6 * y_ref.abs().max()
    exact = torch.relu(x.double() @ w_up.double().T) ** 2 @ w_down.double()
    assert (y.double() - exact).norm() / exact.norm() < (0.08 if headroom > 1 else 0.3)
    y.backward(dy)
    # bf16 backward from the saved post: dW2 = post^T g, dpre = (g W2^T) 2 sqrt(post), dW1 = dpre^T x, dx = dpre W1
    g = dy.double()
    dpre = (g @ w_down.double().T) * 2 * post_ref.sqrt()
    for got, want in ((w_down_.grad, post_ref.T @ g), (w_up_.grad, dpre.T @ x.double()), (x_.grad, dpre @ w_up.double())):
        assert got.dtype == torch.bfloat16
        assert (got.double() - want).abs().max() <= 2e-2 * want.abs().max()


def test_fp8_ops_cuda_bodies_launch_their_kernels():
    """fp8_mlp's and fp8_head_loss's own bodies (the CUDA kernels; CPU tensors take the kernels registered
    below the fence) launch the up-projection and the loss kernel themselves: run here on CPU tensors
    under the Triton interpreter (conftest.py), they give the bits of the kernels' Triton paths around
    the same emulated float8 matmuls."""
    tk = tg.triton_kernels
    x, w_up, w_down, _ = mlp_inputs(seed=2)
    operands = mlp_op_operands(fp8_state(w_up, w_down), x)
    y, post, post_max = tg.fp8_mlp._init_fn(x, w_up, w_down, *operands)  # the decorated function: CUDA's body
    x_f8, up_f8, dequant, down_f8_t, down_scale, act_scale = operands
    want_post, want_post_f8, want_max = tk.relu2_fp8_up_triton(x_f8, up_f8, dequant, act_scale)
    assert torch.equal(post, want_post) and torch.equal(post_max, want_max) and post_max.shape == (3,)
    assert torch.equal(y, tg._scaled_matmul(want_post_f8, down_f8_t.mT, act_scale, down_scale, torch.bfloat16, True))
    x, w, targets, mtp, prefix, pi = _head_inputs()
    x_f8, w_f8 = tg._quantize_fp8(x, 0.1, E4M3), tg._quantize_fp8(w.T, 0.01, E4M3).T
    got = tg.fp8_head_loss._init_fn(x, w, x_f8, w_f8, targets, mtp, prefix, pi, 0.1, 0.01, 1e-4, 0.5)
    logits = tg._scaled_matmul(x_f8, w_f8, 0.1, 0.01, torch.bfloat16, True)
    want = tk.softcapped_ce_mtp_e5m2(logits, targets, mtp, prefix, pi, 0.5, 1e-4, kernel=True)
    assert got[2].dtype == torch.float8_e5m2
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e5m2 else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e5m2 else b) for a, b in zip(got, want))


def test_fp8_mlp_backward_is_the_post_only_bf16_backward():
    """The FP8 op's gradients are exactly relu2_mlp_backward's from the post it returned."""
    x, w_up, w_down, dy = mlp_inputs(seed=1)
    state = fp8_state(w_up, w_down)
    ins = [t.clone().requires_grad_(True) for t in (x, w_up, w_down)]
    y, post, _ = tg.fp8_mlp(*ins, *mlp_op_operands(state, x))
    y.backward(dy)
    want = tg.triton_kernels.relu2_mlp_backward(dy, x, w_up, w_down, post)
    for t, w in zip(ins, want):
        assert torch.equal(t.grad, w)


def test_fp8_delayed_scaling_bookkeeping_over_three_steps(monkeypatch):
    """Quantize before step 0, three forwards, each followed by an 'optimizer step' that changes the
    weights and a quantize; every scale the op receives is checked against a hand computation."""
    L, T, D, H = 2, 32, 32, 48
    g = torch.Generator().manual_seed(3)
    bank = torch.zeros(2 * L, H, D)
    bank[0::2] = (torch.rand(L, H, D, generator=g) * 2 - 1) / 32
    bank = bank.bfloat16()  # W2 = 0 at init, as in the model
    seen = []
    real = tg.fp8_mlp

    def spy(*args):
        seen.append({"act": float(args[8]), "down": float(args[7]), "up_dequant": float(args[5])})
        out = real(*args)
        seen[-1]["post_amax"] = float(out[2].amax())
        return out

    monkeypatch.setattr(tg, "fp8_mlp", spy)
    state = tg.FP8MLPState(L, H, D)
    state.quantize(bank, bootstrap=True)  # before step 0
    assert (state.down_f8_t.float() == 0).all()
    assert state.down_scale[:, 0].tolist() == pytest.approx([1e-12 / 448] * L, rel=1e-6)

    def forward():
        x = tg.norm(torch.randn(T, D, generator=g)).bfloat16()
        state.update_act_scales([state.mlp(layer, x, bank[2 * layer], bank[2 * layer + 1])[1] for layer in range(L)])

    def amax(t):
        return float(t.float().abs().max())

    # step 0: act scales start at 1.0; the first W2 update quantises with bootstrap (current amax / 448)
    forward()
    assert [c["act"] for c in seen] == [1.0, 1.0]
    bank[1::2] = (0.01 * torch.randn(L, H, D, generator=g)).bfloat16()
    state.quantize(bank, bootstrap=True)
    for layer in range(L):
        w2 = amax(bank[2 * layer + 1])
        assert float(state.down_scale[layer, 0]) == pytest.approx(w2 / 448, rel=1e-6)
        assert float(state.down_next_scale[layer, 0]) == pytest.approx(w2 * 1.12 / 448, rel=1e-6)
        assert float(state.up_scale[layer, 0]) == pytest.approx(amax(bank[2 * layer]) / 448, rel=2 ** -8)  # bf16
        assert state.down_f8_t[layer].float().abs().max() == 448  # no headroom: the largest maps to 448
    # step 1: act scale = the previous forward's amax of post * 1.80 / 448; W2 grows 1.5x and is
    # quantised with the scale taken at step 0, so its largest entries clip at 448
    forward()
    for layer in range(L):
        assert seen[2 + layer]["act"] == pytest.approx(seen[layer]["post_amax"] * 1.80 / 448, rel=1e-6)
        assert seen[2 + layer]["down"] == pytest.approx(amax(bank[2 * layer + 1]) / 448, rel=1e-6)
    prev_next = state.down_next_scale.clone()
    bank[1::2] *= 1.5
    state.quantize(bank, bootstrap=False)
    assert torch.equal(state.down_scale, prev_next)
    for layer in range(L):
        w2 = bank[2 * layer + 1].float()
        q = state.down_f8_t[layer].float().T
        clipped = (w2 / prev_next[layer, 0]).abs() > 448
        assert clipped.any() and (q[clipped].abs() == 448).all()
        assert float(state.down_next_scale[layer, 0]) == pytest.approx(amax(w2) * 1.12 / 448, rel=1e-6)
    # step 2: the same rules once more, with the headroom scale from step 1
    forward()
    for layer in range(L):
        assert seen[4 + layer]["act"] == pytest.approx(seen[2 + layer]["post_amax"] * 1.80 / 448, rel=1e-6)
        assert seen[4 + layer]["down"] == pytest.approx(float(prev_next[layer, 0]), rel=1e-6)
    assert float(state.act_scale[1, 0]) == pytest.approx(seen[5]["post_amax"] * 1.80 / 448, rel=1e-6)
    assert (tg.FP8_BOOTSTRAP_STEPS, tg.FP8_ACT_HEADROOM, tg.FP8_DOWN_W_HEADROOM) == (16, 1.80, 1.12)


def test_fp8_mlp_compiles_fullgraph_like_eager():
    """The op and the in-place act-scale update trace into one graph (AOTAutograd), with the eager
    results, gradients and scale update."""
    x, w_up, w_down, dy = mlp_inputs(T=32, D=32, H=48, seed=4)
    results = []
    for compiled in (False, True):
        state = fp8_state(w_up, w_down)

        def mlp(*ins):
            y, post_max = state.mlp(0, *ins)
            state.update_act_scales([post_max])
            return y
        fn = torch.compile(mlp, backend="aot_eager", fullgraph=True) if compiled else mlp
        ins = [t.clone().requires_grad_(True) for t in (x, w_up, w_down)]
        y = fn(*ins)
        y.backward(dy)
        results.append((y.detach(), *(t.grad for t in ins), state.act_scale.clone()))
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager, rtol=0, atol=0)
    assert results[0][-1][0, 0] != 1.0


def test_fp8_mlp_opcheck():
    x, w_up, w_down, _ = mlp_inputs(T=32, D=32, H=48, seed=5)
    state = fp8_state(w_up, w_down)
    args = (x.requires_grad_(), w_up.requires_grad_(), w_down.requires_grad_(), *mlp_op_operands(state, x.detach()))
    # test_schema multiplies every input, which float8 tensors do not support on the CPU; the compile
    # test above covers AOTAutograd
    torch.library.opcheck(tg.fp8_mlp, args, test_utils=("test_autograd_registration", "test_faketensor"))


def test_fp8_mlp_errors():
    x, w_up, w_down, _ = mlp_inputs(T=32, D=32, H=48)
    state = fp8_state(w_up, w_down)
    with pytest.raises(ValueError, match=r"x must be \(T, 32\), .* got x \(32, 16\) torch.bfloat16, w_up \(48, 32\)"):
        state.mlp(0, x[:, :16], w_up, w_down)
    with pytest.raises(ValueError, match=r"w_up and w_down \(48, 32\), .* w_down \(32, 48\) torch.bfloat16$"):
        state.mlp(0, x, w_up, w_down.T)
    with pytest.raises(ValueError, match=r"all bf16; got x \(32, 32\) torch.float32"):
        state.mlp(0, x.float(), w_up, w_down)
    with pytest.raises(ValueError, match="mlp_bank must be"):
        state.quantize(torch.stack([w_up, w_down])[:, :, :16], bootstrap=True)
    with pytest.raises(ValueError, match="post_maxima must hold 1 layers"):
        state.update_act_scales([])


def _mlp_model(fp8: bool):
    args = tg.parse_args(["--preset", "test", "--fp8", str(fp8), "--vocab_size", "1000", "--padded_vocab_size", "1024"])
    torch.manual_seed(0)
    model = tg.GPT(args)
    with torch.no_grad():  # trained-looking down-projections, so the MLPs matter to the loss
        model.mlp_bank[1::2] = 0.02 * torch.randn_like(model.mlp_bank[1::2])
    model.quantize_fp8(bootstrap=True)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (129,), generator=g)
    batch = (tokens[:-1], tokens[1:], torch.tensor([0, 60, 128, 128], dtype=torch.int32),
             tg.bigram_hash(tokens[:-1], args.ngram_rows))
    return model, batch


def test_model_training_forward_takes_the_fp8_mlp_path(monkeypatch):
    """With FP8 tensor cores (pretended on the CPU) the training forward runs every MLP through the
    FP8 state, close to the bf16 MLPs; evaluation and --fp8 false stay bf16."""
    calls = []
    real = tg.FP8MLPState.mlp
    monkeypatch.setitem(tg.MLPS, "fp8", lambda self, layer, *a: calls.append(layer) or real(self, layer, *a))
    monkeypatch.setattr(tg, "_native_fp8", lambda device: True)
    monkeypatch.setattr(tg, "fp8_matmul", lambda x, w, *scales: x @ w)  # the head in bf16: compare MLPs only
    losses, grads = {}, {}
    for fp8 in (True, False):
        model, batch = _mlp_model(fp8)
        loss, _ = model(*batch, mtp_weights=torch.tensor([1.0, 0.5]), loss_scale=1 / 128)
        loss.backward()
        losses[fp8], grads[fp8] = loss.item(), model.mlp_bank.grad.float()
        if fp8:
            assert calls == list(range(model.args.num_layers))
            assert (model.fp8_mlp.act_scale[:, 0] != 1.0).all()  # this forward's amax recorded for the next
            calls.clear()
            with torch.no_grad():
                model(*batch)  # evaluation
            assert calls == []
    assert calls == []
    assert losses[True] != losses[False] and losses[True] == pytest.approx(losses[False], rel=1e-2)
    assert (grads[True] - grads[False]).norm() / grads[False].norm() < 0.1


def test_fp8_state_rides_in_the_state_dict(monkeypatch):
    """The warm-up reset and checkpoints restore model.state_dict(): the FP8 MLP state is in it, so
    the activation scales return to 1.0 and the weight copies to the snapshot's. The head's e4m3 copy
    is not (it is lm_head's, quantised): loading makes it again from the loaded lm_head."""
    monkeypatch.setattr(tg, "_native_fp8", lambda device: True)
    model, batch = _mlp_model(True)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    assert {"fp8_mlp.up_f8", "fp8_mlp.up_scale", "fp8_mlp.down_f8_t", "fp8_mlp.down_scale",
            "fp8_mlp.down_next_scale", "fp8_mlp.act_scale"} <= set(snapshot) and "lm_head_f8_t" not in snapshot
    head_copy = model.lm_head_f8_t.clone()
    model(*batch, mtp_weights=torch.tensor([1.0, 0.5]))[0].backward()
    with torch.no_grad():
        model.mlp_bank.mul_(1.1)
        model.lm_head.mul_(1.1)
    model.quantize_fp8(bootstrap=False)
    assert (model.fp8_mlp.act_scale[:, 0] != 1.0).all()
    assert not torch.equal(_bytes(model.lm_head_f8_t), _bytes(head_copy))  # quantize_fp8 moved it ...
    model.load_state_dict(snapshot)
    assert (model.fp8_mlp.act_scale == 1.0).all()
    for name in ("up_f8", "down_f8_t"):
        assert torch.equal(getattr(model.fp8_mlp, name).view(torch.uint8), snapshot[f"fp8_mlp.{name}"].view(torch.uint8))
    assert torch.equal(_bytes(model.lm_head_f8_t), _bytes(head_copy))  # ... and the load made it again
    assert torch.equal(_bytes(model.lm_head_f8_t), _bytes(tg.fp8_head_weight(snapshot["lm_head"])))


def test_every_layers_scales_are_16_byte_aligned():
    """cuBLASLt rejects scale pointers that are not 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED on an H100
    for offsets 4, 8, 12): each layer's scales must start a 16-byte slot, so every layer's MLP runs
    through the checked _scaled_mm call (emulated on the CPU, with the same checks)."""
    L, T, D, H = 5, 32, 32, 48
    g = torch.Generator().manual_seed(6)
    bank = ((torch.rand(2 * L, H, D, generator=g) * 2 - 1) / 32).bfloat16()
    state = tg.FP8MLPState(L, H, D)
    state.quantize(bank, bootstrap=True)
    x = tg.norm(torch.randn(T, D, generator=g)).bfloat16()
    maxima = []
    for layer in range(L):
        for name in ("up_scale", "down_scale", "act_scale", "down_next_scale"):
            assert getattr(state, name)[layer, 0].data_ptr() % 16 == 0, (name, layer)
        maxima.append(state.mlp(layer, x, bank[2 * layer], bank[2 * layer + 1])[1])
    state.update_act_scales(maxima)
    assert (state.act_scale[:, 0] != 1.0).all()  # every layer's forward ran and recorded its amax
    # a layer without MLP (record #92's removed layer) has no maximum: its scale stays, the others move
    before = state.act_scale[:, 0].clone()
    state.update_act_scales([m * 2 if layer != 2 else None for layer, m in enumerate(maxima)])
    after = state.act_scale[:, 0]
    assert after[2] == before[2] and all(after[i] == (2 * maxima[i].amax()).clamp_min(tg.FP8_SCALE_FLOOR)
                                         * (tg.FP8_ACT_HEADROOM / tg.E4M3_MAX) for i in (0, 1, 3, 4))


# ---- what the compiled graph sees: float8 operands made outside the custom ops --------------------


def old_head_loss(x, w, targets, mtp, prefix, pi, grad_scale):
    """The FP8 head as one op computed it before the quantisation moved out (x and w quantised inside,
    every micro-batch): (per-token loss, dx bf16, dw in w's dtype), from the same primitives."""
    xs, ws, gs = tg.FP8_HEAD_X_SCALE, tg.FP8_HEAD_W_SCALE, tg.FP8_HEAD_GRAD_SCALE * grad_scale
    x_f8 = tg._quantize_fp8(x, xs, E4M3)
    w_f8 = tg._quantize_fp8(w.T, ws, E4M3).T
    logits = tg._scaled_matmul(x_f8, w_f8, xs, ws, torch.bfloat16, fast_accum=True)
    loss, _, g_f8 = tg.triton_kernels.softcapped_ce_mtp_e5m2(logits, targets, mtp, prefix, pi, grad_scale, gs)
    dx, dw = tg.fp8_matmul_grads(g_f8, x_f8, w_f8, xs, ws, gs)
    return loss, dx.to(x.dtype), dw.to(w.dtype)


def _bytes(t):
    return t.view(torch.uint8)


def test_fp8_head_graph_path_is_bitwise_the_quantise_inside_op():
    """fp8_head_loss on fp8_head_input(x) and fp8_head_weight(w): the loss, dx and dw bitwise those of
    the op that quantised inside, and both float8 operands the float64 quantisation's."""
    x, w, targets, mtp, prefix, pi = _head_inputs(T=64, K=32, N=96)
    w = w * 0.01  # in the head scale's range
    grad_scale = 1 / 64
    a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
    x_f8, w_f8_t = tg.fp8_head_input(a), tg.fp8_head_weight(b.detach())
    assert not x_f8.requires_grad and w_f8_t.shape == (96, 32) and w_f8_t.is_contiguous()
    assert torch.equal(x_f8.float(), (x.double() / tg.FP8_HEAD_X_SCALE).bfloat16().to(E4M3).float())
    assert torch.equal(w_f8_t.T.float(), (w.double() / tg.FP8_HEAD_W_SCALE).bfloat16().to(E4M3).float())
    loss, _, _ = tg.fp8_head_loss(a, b, x_f8, w_f8_t.T, targets, mtp, prefix, pi, tg.FP8_HEAD_X_SCALE,
                                  tg.FP8_HEAD_W_SCALE, tg.FP8_HEAD_GRAD_SCALE * grad_scale, grad_scale)
    (loss.sum() * grad_scale).backward()
    ref_loss, ref_dx, ref_dw = old_head_loss(x, w, targets, mtp, prefix, pi, grad_scale)
    assert torch.equal(loss, ref_loss) and torch.equal(a.grad, ref_dx) and torch.equal(b.grad, ref_dw)
    assert a.grad.dtype == b.grad.dtype == torch.bfloat16 and (b.grad != 0).any()


def test_fp8_head_loss_rejects_operands_of_the_wrong_shape_or_dtype_and_a_bad_grad_scale():
    x, w, targets, mtp, prefix, pi = _head_inputs(T=32, K=32, N=48)
    x_f8, w_f8 = tg.fp8_head_input(x), tg.fp8_head_weight(w).T
    for bad, message in (((x_f8[:16], w_f8), "x_f8 must be float8_e4m3fn of shape \\(32, 32\\)"),
                         ((x_f8, w_f8.to(E5M2)), "w_f8 must be float8_e4m3fn"),
                         ((x.clone(), w_f8), "x_f8 must be float8_e4m3fn")):
        with pytest.raises(ValueError, match=message):
            tg.fp8_head_loss(x, w, *bad, targets, mtp, prefix, pi, 0.1, 0.01, 1e-4, 1.0)
    for grad_s in (0.0, -1e-4, float("inf")):  # the CUDA body divides by it before any kernel checks it
        with pytest.raises(ValueError, match=r"fp8_head_loss: grad_s must be a finite number > 0, got"):
            tg.fp8_head_loss(x, w, x_f8, w_f8, targets, mtp, prefix, pi, 0.1, 0.01, grad_s, 1.0)


def test_model_fp8_head_is_bitwise_the_quantise_inside_op_and_reads_the_step_copy(monkeypatch):
    """In the model (FP8 tensor cores pretended): quantize_fp8 leaves lm_head / FP8_HEAD_W_SCALE in e4m3
    (transposed) in lm_head_f8_t; the training loss, lm_head's gradient and the head input's gradient
    are bitwise the quantise-inside op's. The copy is made once per optimizer step: after lm_head
    changes, a forward without quantize_fp8 still reads the old copy (the same loss bits), one after it
    the new."""
    monkeypatch.setattr(tg, "_native_fp8", lambda device: True)
    model, batch = _mlp_model(True)  # quantize_fp8(bootstrap=True) done
    with torch.no_grad():
        model.lm_head.normal_(0, 0.02)
    model.quantize_fp8(bootstrap=False)
    want = (model.lm_head.detach().T.contiguous().double() / tg.FP8_HEAD_W_SCALE).bfloat16().to(E4M3)
    assert torch.equal(_bytes(model.lm_head_f8_t), _bytes(want))

    seen = []
    real = tg.fp8_head_loss

    def spy(x, w, *rest):
        x.retain_grad()
        seen.append((x, w, rest))
        return real(x, w, *rest)

    monkeypatch.setattr(tg, "fp8_head_loss", spy)
    mtp = torch.tensor([1.0, 0.5])
    act = model.fp8_mlp.act_scale.clone()

    def run():  # from the same act scales each time: the MLPs' delayed scales move with every forward
        model.fp8_mlp.act_scale.copy_(act)
        model.zero_grad(set_to_none=True)
        loss, _ = model(*batch, mtp_weights=mtp, loss_scale=1 / 128, prefix_weight=torch.tensor(0.25))
        loss.backward()
        return loss.detach()

    loss = run()
    x, w, rest = seen[-1]
    assert w is model.lm_head and rest[0] is not None and torch.equal(_bytes(rest[1].T), _bytes(model.lm_head_f8_t))
    targets, _, prefix_ids, prefix_weight = rest[2:6]
    ref_loss, ref_dx, ref_dw = old_head_loss(x.detach(), model.lm_head.detach(), targets, mtp, prefix_ids,
                                             prefix_weight, 1 / 128)
    assert torch.equal(loss, ref_loss.sum() * (1 / 128))
    assert torch.equal(x.grad, ref_dx) and torch.equal(model.lm_head.grad, ref_dw)

    with torch.no_grad():  # an optimizer-like change of lm_head, no re-quantisation
        model.lm_head.mul_(1.5)
    assert torch.equal(run(), loss)  # the head read the copy of the last quantize_fp8
    model.quantize_fp8(bootstrap=False)
    assert not torch.equal(run(), loss)


def _spy_mlp_op(monkeypatch, seen):
    real = tg.fp8_mlp

    def spy(*args):
        out = real(*args)
        seen.append({"act": args[8].clone(), "post": out[1], "post_max": out[2]})
        return out

    monkeypatch.setattr(tg, "fp8_mlp", spy)


def test_act_scales_are_written_once_from_every_layers_maxima_and_read_a_forward_late(monkeypatch):
    """Three layers, two forwards: each layer's op reads the act scale the previous forward left (1.0
    before the first), and after each forward act_scale[l] = max(post of layer l) * 1.80 / 448, the amax
    computed by hand from the post the layer produced and, within a bf16 step, from the float64
    emulation of the layer; the second forward's inputs are twice as large, so a scale from the current
    forward could not pass for the previous one's."""
    L, T, D, H = 3, 32, 32, 48
    g = torch.Generator().manual_seed(11)
    bank = ((torch.rand(2 * L, H, D, generator=g) * 2 - 1) / 32).bfloat16()
    bank[1::2] *= 3
    state = tg.FP8MLPState(L, H, D)
    state.quantize(bank, bootstrap=True)
    seen = []
    _spy_mlp_op(monkeypatch, seen)
    xs = [tg.norm(torch.randn(T, D, generator=g)).bfloat16() for _ in range(L)]
    previous = torch.ones(L)
    for gain in (1.0, 2.0):
        seen.clear()
        maxima = [state.mlp(layer, xs[layer] * gain, bank[2 * layer], bank[2 * layer + 1])[1] for layer in range(L)]
        assert (state.act_scale[:, 0] == previous).all()  # nothing written before update_act_scales
        state.update_act_scales(maxima)
        for layer in range(L):
            assert float(seen[layer]["act"]) == float(previous[layer])
            amax = seen[layer]["post"].float().max()
            assert torch.equal(seen[layer]["post_max"].amax(), amax)
            assert float(state.act_scale[layer, 0]) == float(amax * (1.80 / 448))
            _, _, amax64 = fp8_mlp_emulation(xs[layer] * gain, bank[2 * layer], bank[2 * layer + 1], 1.0)
            assert float(amax) == pytest.approx(float(amax64), rel=2 ** -7)
        assert len(set(state.act_scale[:, 0].tolist())) == L  # every layer its own
        now = state.act_scale[:, 0].clone()
        assert (now > 2 * previous).all() or gain == 1.0
        previous = now
    assert (state.act_scale[:, 1:] == 1.0).all()  # only the 16-byte slots' first entries are scales


def _graph_counts(gm) -> dict:
    counts = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            counts[str(n.target)] = counts.get(str(n.target), 0) + 1
    return counts


def test_compiled_fp8_mlps_one_op_per_layer_and_one_act_scale_write():
    """Three FP8 MLP layers and the act-scale update compiled whole (fullgraph, AOTAutograd): the
    forward graph holds one speedrun::fp8_mlp per layer and no other custom op; x's amax per layer and
    the one reduction of the stacked maxima are graph ops (4 amax); act_scale is written once (one
    select_scatter); results, gradients and scales are the eager ones bit for bit."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    L, T, D, H = 3, 32, 32, 48
    g = torch.Generator().manual_seed(12)
    bank = ((torch.rand(2 * L, H, D, generator=g) * 2 - 1) / 32).bfloat16()
    x0 = tg.norm(torch.randn(T, D, generator=g)).bfloat16()
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    results = []
    for compiled in (False, True):
        state = tg.FP8MLPState(L, H, D)
        state.quantize(bank, bootstrap=True)

        def layers(x, bank):
            maxima = []
            for layer in range(L):
                y, post_max = state.mlp(layer, x, bank[2 * layer], bank[2 * layer + 1])
                maxima.append(post_max)
                x = tg.norm(x + y)
            state.update_act_scales(maxima)
            return x

        fn = torch.compile(layers, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True) \
            if compiled else layers
        x, b = x0.clone().requires_grad_(), bank.clone().requires_grad_()
        for _ in range(2):  # the second forward reads the first's act scales
            out = fn(x, b)
            out.float().square().sum().backward()
        results.append((out.detach(), x.grad, b.grad, state.act_scale.clone()))
    for eager, comp in zip(*results):
        assert torch.equal(comp, eager)
    forward, backward = graphs[0], graphs[1]
    fw, bw = _graph_counts(forward), _graph_counts(backward)
    assert {k: v for k, v in fw.items() if "speedrun" in k} == {"speedrun.fp8_mlp.default": L}, fw
    assert fw["aten.amax.default"] == L + 1 and fw["aten.select_scatter.default"] == 1, fw
    assert {k: v for k, v in bw.items() if "speedrun" in k} == {"speedrun.relu2_mlp_bwd.default": L}, bw
