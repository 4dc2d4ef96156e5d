"""ANVIL (record #92's matrix optimizer, --matrix_optimizer anvil) on a CPU, against independent numbers:
record #92's published band of its six maps, float64 hand computations of the cascade and of whole
steps, and its rail schedule at its own step numbers. The runs on 1 to 8 gloo ranks are in
test_optimizer.py (its vo_bank steps with ANVIL), compared there with one process."""
from __future__ import annotations

import dataclasses
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_gpt as T  # noqa: E402


def composed(s: torch.Tensor) -> torch.Tensor:
    for a, b, c in T.ANVIL_MAPS:
        s = a * s + b * s**3 + c * s**5
    return s


def test_the_six_maps_give_record_92s_band_and_diverge_just_above_it():
    """#92's README: singular values in [3e-3, 1/1.05] land in [0.9951, 1.00041]; its fact sheet: the
    product of the a's is 643.1335, f(0.9525) = 23 and f(0.953) = 7.9e11 (no margin above 1/1.05)."""
    band = composed(torch.linspace(3e-3, 1 / 1.05, 200_001, dtype=torch.float64))
    assert band.min().item() == pytest.approx(0.99507, abs=1e-5)
    assert band.max().item() == pytest.approx(1.000401, abs=1e-6)
    assert math.prod(a for a, _, _ in T.ANVIL_MAPS) == pytest.approx(643.1335, abs=1e-4)
    above = composed(torch.tensor([0.9525, 0.953], dtype=torch.float64))
    assert above[0].item() == pytest.approx(23.2, abs=0.1) and above[1].item() > 7e11


def cascade64(G: torch.Tensor) -> torch.Tensor:
    """ANVIL's cascade in float64: X / (1.05 ||X||_F + 1e-6), then X <- a X + (b A + c A^2) X with
    A = X X^T (X (b A + c A^2) with A = X^T X for tall matrices)."""
    X = G.double()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.05 + 1e-6)
    tall = X.size(-2) > X.size(-1)
    for a, b, c in T.ANVIL_MAPS:
        A = X.mT @ X if tall else X @ X.mT
        B = b * A + c * A @ A
        X = a * X + (X @ B if tall else B @ X)
    return X


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape", [(3, 24, 40), (2, 40, 24), (2, 32, 32), (1, 1100, 48)],
                         ids=["wide", "tall", "square", "tall_split"])
def test_cascade_against_float64(shape):
    torch.manual_seed(0)
    G = torch.randn(shape)
    ref = cascade64(G)
    assert rel_err(T.anvil_cascade(G, dtype=torch.float32), ref) < 2e-5
    got = T.anvil_cascade(G)  # bf16, as on a GPU
    assert got.dtype == torch.bfloat16 and got.shape == G.shape and rel_err(got, ref) < 3e-2
    # every singular value that started in [3e-3, 1/1.05] near one: the band, widened by bf16's rounding
    s_in = torch.linalg.svdvals(G.double()) / (G.double().norm(dim=(-2, -1), keepdim=True).squeeze(-1) * 1.05)
    s = torch.linalg.svdvals(got.double())[s_in >= 3e-3]
    assert 0.98 < s.min() and s.max() < 1.02


def anvil64(p0, grads, lr, wd, schedule, lr_mul=1.0, matrix_mul=None, wd_mul=1.0, beta2=0.9, slow_beta=0.98):
    """ANVIL on a bank (n, r, c) in float64 from record #92's description; schedule: per step (lr scale,
    rail beta, fast beta, fast weight). Returns (param, fast rail, slow rail, lane energy)."""
    p = p0.double().clone()
    n, r, c = p.shape
    fast, slow = torch.zeros_like(p), torch.zeros_like(p)
    energy = torch.zeros(n, r, 1, dtype=torch.float64) if r >= c else torch.zeros(n, 1, c, dtype=torch.float64)
    mm = torch.ones(n, dtype=torch.float64) if matrix_mul is None else torch.tensor(matrix_mul, dtype=torch.float64)
    for g, (scale, mu, fast_beta, w) in zip(grads, schedule):
        g = g.double()
        fast = fast_beta * fast + (1 - fast_beta) * g
        slow = slow_beta * slow + (1 - slow_beta) * g
        u = (1 - mu) * g + mu * (w * fast + (1 - w) * slow)
        O = cascade64(u)
        lane = (O**2).mean(dim=-1 if r >= c else -2, keepdim=True)
        energy = beta2 * energy + (1 - beta2) * lane
        E = O / energy.clamp_min(1e-10).sqrt()
        E = E * O.norm(dim=(-2, -1), keepdim=True) / E.norm(dim=(-2, -1), keepdim=True)
        eff = lr * scale * lr_mul * math.sqrt(max(1.0, r / c)) * mm.view(-1, 1, 1)
        decay = lr * scale * wd * wd_mul * eff * (slow * p >= 0)  # gated by the slow rail, not the update
        p = p - eff * E - decay * p
    return p, fast, slow, energy


SCHEDULE = [(1.0, 0.85, 0.85, 1.0), (0.9, 0.88, 0.88, 1.0), (0.8, 0.93, 0.85, 0.4385), (0.7, 0.9, 0.85, 0.4385)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("exact_cascade", [True, False], ids=["float64_cascade", "own_cascade"])
def test_anvil_steps_match_float64(dtype, exact_cascade, monkeypatch):
    """Four steps, the rails engaging at the third, each bank's fp32 master against anvil64. With the
    float64 cascade put in, everything else must agree to fp32 rounding; with its own (in the bank's
    dtype) the cascade's rounding on top (bf16's ~1% per step)."""
    if exact_cascade:
        monkeypatch.setattr(T, "anvil_cascade", lambda G, dtype: cascade64(G))
    torch.manual_seed(2)
    shapes = {"wide": (3, 12, 20), "tall": (2, 24, 8)}
    configs = {"wide": T.ParamConfig("anvil", "none", lr_mul=1.5, wd_mul=0.5),
               "tall": T.ParamConfig("anvil", "none", matrix_lr_mul=(1.0, 2.0))}
    p0 = {k: (torch.randn(s) * 0.1).to(dtype) for k, s in shapes.items()}
    params = {k: torch.nn.Parameter(v.clone()) for k, v in p0.items()}
    opt = T.NorMuonAdam(params, configs, scatter_order=list(shapes), work_order=list(shapes), normuon_lr=0.02,
                        anvil_wd=2.25, anvil_slow_beta=0.98)
    grads = {k: [torch.randn(s).to(dtype) for _ in SCHEDULE] for k, s in shapes.items()}
    for i, (scale, mu, fast_beta, w) in enumerate(SCHEDULE):
        for k in shapes:
            params[k].grad = grads[k][i].clone()
        opt.step(do_adam=False, lr_scale=scale, momentum=mu, rails=(fast_beta, w))
    for k, cfg in configs.items():
        p, fast, slow, energy = anvil64(p0[k], grads[k], 0.02, 2.25, SCHEDULE, cfg.lr_mul, cfg.matrix_lr_mul, cfg.wd_mul)
        st = opt.state[k]
        got = T._master_fp32(params[k].data, st.get("mantissa"))
        tol = 2e-5 if exact_cascade else (1e-4 if dtype == torch.float32 else 5e-2)
        assert rel_err(got - p0[k].float(), p - p0[k].double()) < tol, k
        assert rel_err(st["fast_rail"], fast) < 1e-6 and rel_err(st["slow_rail"], slow) < 1e-6
        assert rel_err(st["second_moment"], energy) < (2e-5 if exact_cascade else 0.1)


def test_the_rail_schedule_is_record_92s():
    """#92 (1,174 scheduled steps, 20 more): rail beta 0.85 at step 0, 0.89 at 120, 0.93 from 240 to 1,144,
    0.89 at 1,169, 0.8516 at 1,193; from step 514 the fast rail's beta is 0.85 and its weight 0.4385 (before:
    the rail beta and 1). NorMuon's plan has no rails and #89's momentum."""
    args = dataclasses.replace(T.Hyperparameters(), num_iterations=1174, extension_iterations=20,
                               matrix_optimizer="anvil")
    for step, beta in ((0, 0.85), (120, 0.89), (240, 0.93), (700, 0.93), (1144, 0.93), (1169, 0.89), (1193, 0.8516)):
        assert T.plan_step(args, step).momentum == pytest.approx(beta, abs=1e-12), step
    assert T.plan_step(args, 513).rails == (0.93, 1.0)
    assert T.plan_step(args, 514).rails == (0.85, 0.4385)
    normuon = T.plan_step(dataclasses.replace(args, matrix_optimizer="normuon"), 120)
    assert normuon.rails == () and normuon.momentum == pytest.approx(0.85 + 0.1 * 120 / round(300 / 1270 * 1174))


def test_the_switch_puts_the_banks_on_anvil_and_nothing_else():
    args = T.parse_args(["--preset", "test", "--matrix_optimizer", "anvil"])
    model = T.GPT(args)
    opt = T.build_optimizer(args, model, torch.device("cpu"))
    base = T.optimizer_configs(T.parse_args(["--preset", "test"]), model)
    for label, placement in opt.placements.items():
        want = dataclasses.replace(base[label], optimizer="anvil") if label in ("qk_bank", "vo_bank", "mlp_bank") \
            else base[label]
        assert placement.cfg == want, label
    assert set(opt.state["mlp_bank"]) == {"fast_rail", "slow_rail", "second_moment", "mantissa"}
    assert (opt.anvil_wd, opt.anvil_slow_beta) == (2.25, 0.98)


@pytest.mark.parametrize("flag,value", [("--anvil_rails", "(0.4, 0.85, 0.5)"), ("--anvil_rail_beta", "(0.85, 1.5, 0.2, 0)"),
                                        ("--anvil_wd", "-1")])
def test_bad_anvil_flags_are_one_line_errors(flag, value):
    args = T.parse_args(["--preset", "test", "--matrix_optimizer", "anvil", flag, value])
    with pytest.raises(SystemExit, match=f"error: {flag} "):
        T.check_args(args, 1)
