"""Record #92's hashed n-gram table as switches (--ngram_channels 2, --ngram_optimizer row_adam, --table_cadence):
its row and sign hashes against numbers worked out by hand and against numpy's own int32 arithmetic, the
two channels' features against a float64 sum, and row Adam against a loop over #92's description, where a
row that missed events has their decays replayed when it is next touched."""
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import train_gpt as tg

V92 = 84_602_880  # record #92's rows: the bigram channel [0, 42,301,440), the trigram channel the rest
TOKENS = [50256, 464, 2068, 7586, 21831, 50303]


def test_hash_rows_of_record_92s_table_for_known_tokens():
    """half = 42,301,440, both moduli 42,301,439. Position 0: the bigram sentinel half - 1; position 1's bigram
    reads the sentinel as its previous token (36313 x 464 = 16,849,232; 27191 x 42,301,439 = 1,150,218,427,849,
    -832,807,479 as int32; their XOR mod 42,301,439 = 30,057,605); positions 0 and 1 get the trigram sentinel
    84,602,879."""
    rows = tg.ngram_rows_of(torch.tensor(TOKENS, dtype=torch.int32), V92, 2)
    assert rows.dtype == torch.int64 and rows.shape == (6, 2)
    assert rows[:, 0].tolist() == [42301439, 30057605, 36955973, 25891877, 38010350, 22524677]
    assert rows[:, 1].tolist() == [84602879, 84602879, 79010554, 60889994, 59548946, 45415700]
    # one channel: record #89's bigram over every row
    assert tg.ngram_rows_of(torch.tensor(TOKENS), 377_280, 1)[:, 0].tolist() == tg.bigram_hash(TOKENS, 377_280).tolist()


def numpy_int32_rows(tokens: np.ndarray, rows: int) -> np.ndarray:
    """The two channels in numpy's own int32 arithmetic (its products wrap), np.mod's floor modulo."""
    x = tokens.astype(np.int32)
    half = rows // 2
    mb, ms = np.int32(half - 1), np.int32(rows - half - 1)
    with np.errstate(over="ignore"):
        prev = np.concatenate([[mb], x[1:-1]]).astype(np.int32)
        bigram = np.concatenate([[mb], np.mod(np.int32(36313) * x[1:] ^ np.int32(27191) * prev, mb)])
        tri = np.int32(17351) * x[2:] ^ np.int32(60961) * x[1:-1] ^ np.int32(45259) * x[:-2]
        trigram = np.concatenate([[rows - 1, rows - 1], np.mod(tri, ms).astype(np.int64) + half])
    return np.stack([bigram.astype(np.int64), trigram], axis=1)


@pytest.mark.parametrize("rows", [V92, 4_001, 6])
def test_hash_rows_match_numpy_int32_arithmetic(rows):
    tokens = np.random.default_rng(rows).integers(0, 50_304, size=2_000)
    ours = tg.ngram_rows_of(torch.from_numpy(tokens.astype(np.int32)), rows, 2).numpy()
    assert np.array_equal(ours, numpy_int32_rows(tokens, rows))
    half = rows // 2
    assert ours[:, 0].min() >= 0 and ours[:, 0].max() <= half - 1
    assert ours[:, 1].min() >= half and ours[:, 1].max() <= rows - 1


def test_sign_rows_of_both_channels():
    """Bigram: ((30011 x[t-1]) XOR (48271 x[t])) & 8191, 0 at t = 0; trigram: ((26801 x[t-2]) XOR (39779 x[t-1])
    XOR (58699 x[t])) & 8191, 0 at t < 2 (e.g. t = 1: 30011 x 50256 XOR 48271 x 464 = 3392 in the low 13 bits)."""
    signs = tg.ngram_sign_index(torch.tensor(TOKENS, dtype=torch.int32), 2)
    assert signs[:, 0].tolist() == [0, 3392, 2524, 1506, 6399, 7340]
    assert signs[:, 1].tolist() == [0, 0, 6652, 794, 191, 5698]
    tokens = np.random.default_rng(1).integers(0, 50_304, size=1_000).astype(np.int32)
    with np.errstate(over="ignore"):  # low bits do not depend on the wrap-around
        bi = (np.int32(30011) * tokens[:-1] ^ np.int32(48271) * tokens[1:]) & 8191
        tri = (np.int32(26801) * tokens[:-2] ^ np.int32(39779) * tokens[1:-1] ^ np.int32(58699) * tokens[2:]) & 8191
    signs = tg.ngram_sign_index(torch.from_numpy(tokens), 2).numpy()
    assert np.array_equal(signs[1:, 0], bi) and np.array_equal(signs[2:, 1], tri)
    # one channel: record #89's (x[t-1] XOR x[t]) mod 8192
    assert tg.ngram_sign_index(torch.tensor(TOKENS), 1)[:, 0].tolist() == tg.bigram_sign_index(torch.tensor(TOKENS)).tolist()


def test_two_channels_features_are_the_float64_sum_rounded_once():
    args = tg.parse_args(["--preset", "test", "--ngram_channels", "2"])
    model = tg.GPT(args)
    with torch.no_grad():
        model.bigram_embed.normal_(generator=torch.Generator().manual_seed(0))
    ids = torch.from_numpy(np.random.default_rng(2).integers(0, 50_257, size=64).astype(np.int32))
    rows = tg.ngram_rows_of(ids, args.ngram_rows, 2)
    xb = model.ngram_features(ids, rows)
    table, signs = model.bigram_embed.double(), model.bigram_sign_table.double()
    sign_rows = tg.ngram_sign_index(ids, 2)
    want = table[rows[:, 0]] * signs[sign_rows[:, 0]] + table[rows[:, 1]] * signs[sign_rows[:, 1]]
    assert xb.dtype == model.bigram_embed.dtype
    assert torch.equal(xb, want.to(xb.dtype))
    xb.square().sum().backward()  # the gradient reaches the touched rows of both channels and no other
    touched = set(rows.flatten().tolist())
    nonzero = set((model.bigram_embed.grad != 0).any(1).nonzero().flatten().tolist())
    assert nonzero == touched and any(r >= args.ngram_rows // 2 for r in nonzero)


def replayed_row_adam(p, events, lr, wd, wd_mul, beta2, eps=1e-10):
    """Record #92's row Adam written from its description, in float64: at each event only the rows with a
    gradient move; a row's second moment first takes the decays of the events it missed (the product of their
    beta2s, from a history), then v = b2 v + (1 - b2) mean(g^2); u = lr sqrt(1 - b2^t) g / (sqrt(v) + eps); the
    decay p lr^2 wd wd_mul s where u p > 0. events: (gradient, s), s the stretch (beta2^s, wd_mul x s)."""
    p = p.double().clone()
    v = torch.zeros(p.shape[0], dtype=torch.float64)
    last = [0] * p.shape[0]
    history = [None]
    for t, (g, s) in enumerate(events, start=1):
        b2 = beta2 ** s
        history.append(b2)
        g = g.double()
        for r in range(p.shape[0]):
            if not g[r].any():
                continue
            for missed in range(last[r] + 1, t):
                v[r] *= history[missed]
            v[r] = b2 * v[r] + (1 - b2) * g[r].square().mean()
            last[r] = t
            u = lr * math.sqrt(1 - b2 ** t) * g[r] / (v[r].sqrt() + eps)
            u = u + (u * p[r] > 0).double() * lr * lr * wd * wd_mul * s * p[r]
            p[r] -= u
    return p, v, last, history


def test_row_adam_with_random_gaps_equals_the_replayed_loop():
    rows, width, lr_mul, wd_mul, adam_lr, adam_wd = 24, 8, 70.0, 5.0, 0.008, 0.005
    gen = torch.Generator().manual_seed(3)
    table = nn.Parameter(torch.randn(rows, width, generator=gen) * 0.05)
    table.label = "table"
    start = table.detach().clone()
    cfg = tg.ParamConfig("row_adam", "sharded_sparse", lr_mul=lr_mul, wd_mul=wd_mul, betas=(0.0, 0.95))
    opt = tg.NorMuonAdam({"table": table}, {"table": cfg}, scatter_order=["table"], work_order=["table"],
                         adam_lr=adam_lr, adam_wd=adam_wd, adam_eps=1e-10)
    assert set(opt.state["table"]) == {"row_sq"} and opt.state["table"]["row_sq"].shape == (rows,)
    events = []
    for t in range(14):
        touched = torch.rand(rows, generator=gen) < 0.3  # random gaps: a row waits 1 to many events
        g = torch.randn(rows, width, generator=gen) * touched[:, None]
        s = 1.0 if t < 8 else 2.0  # record #92's cadence from step 336: beta2^2, wd_mul x 2
        events.append((g, s))
        table.grad = g.clone()
        opt.step(do_adam=True, stretch={"table": s})
    want, v, last, history = replayed_row_adam(start, events, adam_lr * lr_mul, adam_wd, wd_mul, 0.95)
    touches = [[t for t, (g, _) in enumerate(events) if g[r].any()] for r in range(rows)]
    assert any(b - a >= 3 for ts in touches for a, b in zip(ts, ts[1:]))  # rows come back after gaps
    assert torch.allclose(table.detach().double(), want, rtol=1e-5, atol=1e-7)
    # a row's moment, caught up to the last event: ours decays every row every event
    caught_up = v * torch.tensor([math.prod(history[e] for e in range(r + 1, 15)) for r in last], dtype=torch.float64)
    assert torch.allclose(opt.state["table"]["row_sq"].double(), caught_up, rtol=1e-5, atol=0)
    never = [r for r in range(rows) if last[r] == 0]
    assert all(torch.equal(table[r], start[r]) for r in never)


def test_row_adam_refuses_momentum():
    with pytest.raises(ValueError, match="row_adam keeps no momentum"):
        tg.ParamConfig("row_adam", "sharded_sparse", betas=(0.75, 0.95))


def test_the_switches_configure_the_table_and_the_cadence_holds_both_tables():
    args = tg.parse_args(["--preset", "test", "--ngram_optimizer", "row_adam", "--table_cadence", "(0.5, 4, 3)"])
    cfg = tg.optimizer_configs(args, tg.GPT(args))["bigram_embed"]
    assert (cfg.optimizer, cfg.betas, cfg.lr_mul, cfg.wd_mul) == ("row_adam", (0.0, 0.95), 75.0, 5.0)
    both = ("value_embeds", "bigram_embed")
    assert {step: tg.plan_step(args, step).held for step in range(2, 7)} == {2: (), 3: (), 4: both, 5: both, 6: both}
    assert dict(tg.plan_step(args, 5).stretch) == {"value_embeds": 2.0, "bigram_embed": 2.0}
    with pytest.raises(SystemExit, match="--ngram_optimizer 'sgd' is not one of adam, row_adam"):
        tg.check_flags(tg.parse_args(["--preset", "test", "--ngram_optimizer", "sgd"]), 1)
    with pytest.raises(SystemExit, match="--ngram_rows must be >= 6 with --ngram_channels 2"):
        tg.check_flags(tg.parse_args(["--preset", "test", "--ngram_channels", "2", "--ngram_rows", "5"]), 1)
