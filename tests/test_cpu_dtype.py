"""CPU compute dtype: forced or chosen by timing, and the fp32 model trains like the bf16 one."""
import dataclasses

import pytest
import torch

import train_gpt as tg

TEST = tg.parse_args(["--preset", "test"])


def test_forced_choice_needs_no_probe(monkeypatch):
    monkeypatch.setattr(tg, "matmul_gflops", lambda *a, **k: pytest.fail("probed although forced"))
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        got, note = tg.choose_cpu_dtype(dataclasses.replace(TEST, cpu_dtype=name))
        assert got == dtype and note.startswith(f"cpu dtype {name} (--cpu_dtype) on ")


@pytest.mark.parametrize("rates, expected", [({torch.bfloat16: 0.6, torch.float32: 53.0}, torch.float32),
                                             ({torch.bfloat16: 120.0, torch.float32: 94.0}, torch.bfloat16)])
def test_auto_takes_the_faster_dtype_at_the_models_shape(monkeypatch, rates, expected):
    shapes = []

    def fake(dtype, m, k, n, seconds=0.15):
        shapes.append((m, k, n))
        return rates[dtype]

    monkeypatch.setattr(tg, "matmul_gflops", fake)
    got, note = tg.choose_cpu_dtype(TEST)
    assert got == expected
    assert shapes == [(256, TEST.model_dim, TEST.mlp_hidden)] * 2
    assert f"bf16 {rates[torch.bfloat16]:.1f}, fp32 {rates[torch.float32]:.1f}" in note and " on " in note


def test_matmul_probe_measures_something():
    rate = tg.matmul_gflops(torch.float32, 64, 64, 64, seconds=0.01)
    assert 0.01 < rate < 1e5


def test_fp32_model_and_optimizer_follow_the_bf16_ones():
    """Same init (drawn before the cast), same step: the fp32 model's loss and first update are those of
    the bf16 model within bf16 rounding, and it keeps no mantissa (fp32 has its own low bits)."""
    losses, moved = {}, {}
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        model = tg.GPT(TEST, dtype=dtype)
        assert model.qk_bank.dtype == dtype and model.scalars.dtype == torch.float32
        opt = tg.build_optimizer(TEST, model, torch.device("cpu"))
        g = torch.Generator().manual_seed(1)
        inputs = torch.randint(0, 50257, (257,), generator=g)
        cu = torch.tensor([0, 100] + [256] * 6, dtype=torch.int32)
        x, y = inputs[:-1].int(), inputs[1:]
        loss, _ = model(x, y, cu, tg.bigram_hash(x, TEST.ngram_rows), mtp_weights=torch.tensor([1.0, 0.5, 0.25]),
                        loss_scale=1 / 256)
        loss.backward()
        before = model.mlp_bank.detach().float().clone()
        opt.step(do_adam=True, lr_scale=1.0, momentum=0.9)
        # the fp32 master value the update was applied to (bf16: the weight's bits joined with the mantissa)
        after = tg._master_fp32(model.mlp_bank.detach(), opt.state["mlp_bank"].get("mantissa"))
        losses[dtype], moved[dtype] = loss.item(), after - before
        assert ("mantissa" in opt.state["mlp_bank"]) == (dtype == torch.bfloat16)
    assert losses[torch.float32] == pytest.approx(losses[torch.bfloat16], rel=1e-3)
    a, b = moved[torch.float32], moved[torch.bfloat16]
    assert a.norm() > 0 and ((a - b).norm() / a.norm()).item() < 0.05
