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
    with pytest.raises(ValueError, match=message):
        tg.check_scaled_mm_args(a, b, sa, sb)


def test_op_rejects_dims_cublas_cannot_take():
    x, w, _ = make_inputs(M=40, K=64, N=80)
    with pytest.raises(ValueError, match="multiples of 16"):
        tg.fp8_matmul(x, w, XS, WS, GS)


# ---- the op inside the model -------------------------------------------------------------------


def _head_run(fp8: bool):
    # a small vocabulary: torch._scaled_mm's CPU kernel is slow at 50k columns
    args = tg.parse_args(["--preset", "test", "--fp8", str(fp8), "--vocab_size", "1000", "--padded_vocab_size", "1024"])
    torch.manual_seed(0)
    model = tg.GPT(args)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (129,), generator=g)
    cu = torch.tensor([0, 60, 128, 128], dtype=torch.int32)
    loss = model(tokens[:-1], tokens[1:], cu, tg.bigram_hash(tokens[:-1], args.bigram_vocab_size),
                 mtp_weights=torch.tensor([1.0, 0.5]), loss_scale=1 / 128)
    loss.backward()
    return loss.item(), model.lm_head.grad.float(), model.mlp_bank.grad.float()


def test_model_training_head_uses_fp8_where_supported(monkeypatch):
    """Pretend the CPU has FP8 tensor cores: the head then goes through torch._scaled_mm (which runs
    on the CPU here) with the static head scales; --fp8 false keeps the bf16 head."""
    calls = []
    real = tg.fp8_matmul
    monkeypatch.setattr(tg, "fp8_matmul", lambda *a: calls.append(a[2:]) or real(*a))
    loss16, head16, mlp16 = _head_run(fp8=True)   # CPU: no FP8 tensor cores, bf16 head
    assert calls == []
    monkeypatch.setattr(tg, "_native_fp8", lambda device: True)
    loss8, head8, mlp8 = _head_run(fp8=True)
    assert calls == [(tg.FP8_HEAD_X_SCALE, tg.FP8_HEAD_W_SCALE, tg.FP8_HEAD_GRAD_SCALE / 128)]
    assert loss8 != loss16 and loss8 == pytest.approx(loss16, rel=1e-3)
    assert (head8 - head16).norm() / head16.norm() < 0.1
    assert (mlp8 - mlp16).norm() / mlp16.norm() < 0.1
    calls.clear()
    assert _head_run(fp8=False)[0] == loss16 and calls == []
