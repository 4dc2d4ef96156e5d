"""The record #89 model's components against independent references: the per-layer table and the MUDD
layouts against the record's indices, a step-by-step forward written with the record's hard-coded
indices, DC and XSA against loops, paired-head rotary positions, key offset, bigram signs, inits."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg
from test_model import bigrams, make_batch, make_model, randomize

# The speedrun table and head count with small tables, so the model fits a CPU test.
RECORD_SMALL = dataclasses.replace(tg.Hyperparameters(), vocab_size=1000, padded_vocab_size=1024, mlp_hidden=64,
                                   ngram_rows=64, window_block_size=16, windows_init=(2, 4))


def test_mudd_gate_layout_is_the_records():
    """Section 1.8's index table: gate 0 (26 outputs) and gate 1 (41)."""
    pre, post = tg.mudd_gate_layout(tg.LAYERS, 6)
    assert pre == {("xsa", 1): (0, 6), ("xsa", 3): (6, 6), ("gate", 3): (12, 6),
                   **{("x0", i): (18 + 2 * i, 1) for i in range(4)}, **{("bigram", i): (19 + 2 * i, 1) for i in range(4)}}
    assert post == {("xsa", 4): (0, 6), ("xsa", 7): (6, 6), ("gate", 10): (12, 6),
                    **{("x0", i): (18 + 2 * n, 1) for n, i in enumerate((4, 5, 7, 8, 9))},
                    **{("bigram", i): (19 + 2 * n, 1) for n, i in enumerate((4, 5, 7, 8, 9))},
                    ("skip", 6): (28, 1), ("dc_w1", 10): (29, 6), ("dc_w2", 10): (35, 6)}


def test_mudd_inits_and_effective_values_at_init():
    """Sections 1.2, 1.8, 1.9: biases stored x10 (layers) or x 1/scale (gates); the effective values in
    bf16 arithmetic are the record's: 2.0 VE gates, 1.046875 resid, 1 post, 0.05 bigram, -0.5 backout,
    gate scale 0.10009765625, output gates 0.25, skip 0.5, DC w1 1.0."""
    model = make_model(RECORD_SMALL)
    assert model.mudd_w1.abs().max().item() <= 1 / math.sqrt(768) * (1 + 2 ** -8)  # bf16 rounding
    assert model.mudd_w1.float().std().item() == pytest.approx(1 / math.sqrt(768) / math.sqrt(3), rel=0.02)
    assert (model.mudd_w2 == 0).all() and (model.mudd_gate_w2 == 0).all()
    assert model.mudd_b2[0, 8].item() == 10.5 and model._mudd_gate_scale.item() == pytest.approx(0.1)
    x = torch.randn(16, 768).bfloat16()
    mu0, mu1 = model._mudd_layer(0, x), model._mudd_layer(1, x)
    assert mu0.shape == (16, 14) and mu1.shape == (16, 5)
    assert (mu0 == mu0[:1]).all() and (mu1 == mu1[:1]).all()  # W2 = 0: the same for every token
    assert mu0[0].tolist() == [0, 0, 0, 0, 0, 0, 2.0, 2.0, 1.046875, 1.0, 0, torch.tensor(0.05).bfloat16().item(),
                               1.046875, 1.0]
    assert mu1[0].tolist() == [0, -0.5, 0, 0, 0]
    scale = torch.tensor(0.1).bfloat16().item()
    assert scale == 0.10009765625
    pre, post = model._mudd_gate(0, x)[0].double(), model._mudd_gate(1, x)[0].double()
    b = lambda v: torch.tensor(v * scale).bfloat16().item()  # noqa: E731  (bf16 product)
    assert pre.shape == (26,) and post.shape == (41,)
    assert pre[12:18].tolist() == [b(2.5)] * 6 and pre[19:26:2].tolist() == [b(0.5)] * 4
    assert pre[:12].abs().sum() == 0 and pre[18:26:2].abs().sum() == 0
    assert post[12:18].tolist() == [b(2.5)] * 6 and post[19:28:2].tolist() == [b(0.5)] * 5
    assert post[28].item() == b(5.0) and post[29:35].tolist() == [b(10.0)] * 6
    assert post[:12].abs().sum() == 0 and post[18:28:2].abs().sum() == 0 and post[35:].abs().sum() == 0
    assert b(2.5) == pytest.approx(0.25, abs=1e-3) and b(10.0) == pytest.approx(1.0, abs=1e-2)


def test_bigram_sign_table_and_index():
    model = make_model(RECORD_SMALL)
    signs = model.bigram_sign_table
    assert signs.shape == (8192, 768) and signs.dtype == torch.bfloat16
    assert set(signs.unique().tolist()) == {-1.0, 1.0} and abs(signs.float().mean().item()) < 0.01
    ids = torch.randint(0, 50257, (100,))
    ref = [0] + [(int(ids[t - 1]) ^ int(ids[t])) % 8192 for t in range(1, 100)]
    assert tg.bigram_sign_index(ids).tolist() == ref


def test_key_offset_and_xsa_against_loops():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(7, 2, 8, generator=g, dtype=torch.float64)
    out = tg.key_offset(k)
    for t in range(7):
        assert torch.equal(out[t, :, :4], k[t, :, :4])  # the rotated half stays
        assert torch.equal(out[t, :, 4:], k[max(t - 1, 0), :, 4:])
    y, v = (torch.randn(5, 3, 8, generator=g, dtype=torch.float64) for _ in range(2))
    alpha = torch.randn(5, 3, generator=g, dtype=torch.float64)
    v[0, 0] = 0  # |v|^2 clamped at 1e-8: no division by zero
    got = tg.xsa(y, v, alpha)
    for t in range(5):
        for h in range(3):
            coef = math.tanh(alpha[t, h]) * float(y[t, h] @ v[t, h]) / max(float(v[t, h] @ v[t, h]), 1e-8)
            torch.testing.assert_close(got[t, h], y[t, h] - coef * v[t, h], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T, window", [(40, 7), (300, 112), (130, 1)])
def test_dc_term_against_a_loop_over_tokens(T, window):
    """Section 1.10: per token, a separate softmax per head over the keys of its document at most
    window - 1 back, mixed over heads by w1, times w2 per head (float64; bands and padding cross T)."""
    g = torch.Generator().manual_seed(T)
    H, hd = 3, 4
    q, k, v = (torch.randn(T, H, hd, generator=g, dtype=torch.float64) for _ in range(3))
    w1, w2 = (torch.randn(T, H, generator=g, dtype=torch.float64) for _ in range(2))
    starts = [0, T // 3, T // 3 + 5, T - 2]
    doc = torch.tensor([sum(t >= s for s in starts) - 1 for t in range(T)])
    got = tg.dc_term(q, k, v, doc, w1, w2, window)
    want = torch.zeros(T, H, hd, dtype=torch.float64)
    for t in range(T):
        keys = [s for s in range(t + 1) if t - s < window and doc[s] == doc[t]]
        A = sum(w1[t, h] * torch.softmax(torch.stack([q[t, h] @ k[s, h] for s in keys]), 0) for h in range(H))
        for h in range(H):
            want[t, h] = w2[t, h] * sum(A[n] * v[s, h] for n, s in enumerate(keys))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_paired_rotary_positions_follow_the_records_view():
    """Section 1.7: heads viewed as pairs (2p, 2p+1) rotated at 2t and 2t+1, so head 1 (slot 2t) is at
    position 2t+1 and head 4 (slot 2t+1) at 2t."""
    freq = tg.rotary_base_frequencies(128)
    tables = tg.rotary_tables(freq, 10, 6, torch.float32)
    cos, sin = tables["paired"]
    assert cos.shape == (10, 6, 32)
    for t in range(10):
        for h in range(6):
            pos = 2 * t + (h % 2)
            torch.testing.assert_close(cos[t, h].double(), torch.cos(pos * freq.double()), rtol=0, atol=1e-5)
            torch.testing.assert_close(sin[t, h].double(), torch.sin(pos * freq.double()), rtol=0, atol=1e-5)
    torch.testing.assert_close(tables["plain"][0][3].double(), torch.cos(3 * freq.double()), rtol=0, atol=1e-5)


def test_key_offset_crosses_documents():
    """The record's key offset reads the previous packed position even across a document start: a
    change inside document 2 reaches document 3 through layer 1's keys, and never document 1."""
    model = make_model()
    randomize(model)
    inputs, _, cu = make_batch()  # documents [0, 30), [30, 70), [70, 100), [100, 128)
    changed = inputs.clone()
    changed[40:60] = (changed[40:60] + 11) % 50257
    with torch.no_grad():
        base, out = (tg.bf16_logits(model, ids, cu, bigrams(ids)) for ids in (inputs, changed))
        assert torch.equal(out[:30], base[:30]) and not torch.allclose(out[70:100], base[70:100])
        off = make_model(tg.ablated(model.args, ["key_offset"]))
        off.load_state_dict(model.state_dict())
        assert torch.equal(*(tg.bf16_logits(off, ids, cu, bigrams(ids))[70:] for ids in (changed, inputs)))


def record_forward(model, ids, cu, big):
    """Section 1.5 step by step with the record's hard-coded indices (11 layers, pre 26 / post 41
    coefficients, cache[0/3/7/9]); the attention block itself is the model's (tested on its own)."""
    T, H, hd = ids.numel(), 6, 128
    doc = tg.document_ids(cu, T)
    s = model.scalars
    e = F.embedding(ids, model.embed)
    xb = F.embedding(big, model.bigram_embed) * model.bigram_sign_table[tg.bigram_sign_index(ids)]
    ve = [F.embedding(ids, t) for t in model.value_embeds]
    e = torch.cat([e[:1], e[1:] + s[22].bfloat16() * torch.sigmoid(e[1:, :12] @ model.smear_gate.T) * e[:-1]])
    x0 = tg.norm(e)
    gate = lambda k, x, n: (F.linear(F.gelu(F.linear(x, model.mudd_gate_w1[k])), model.mudd_gate_w2[k, :n],  # noqa: E731
                                     model.mudd_gate_b2[k, :n]) * model._mudd_gate_scale.bfloat16())
    layer = lambda k, x, n: F.linear(F.gelu(F.linear(x, model.mudd_w1[k])), model.mudd_w2[k, :n], model.mudd_b2[k, :n]) * 0.1  # noqa: E731
    pre, post = gate(0, x0, 26), None
    coefs = {}

    def coef(kind, i):
        return coefs[kind, i]

    x = x0 + pre[:, 19:20] * xb
    cache = {0: x}
    resid, postl = model.resid_lambdas.bfloat16(), model.post_lambdas.bfloat16()
    rope = {"long": tg.rotary_tables(model.rotary_freq, T, H, torch.bfloat16)}
    masks = model.attention_masks(cu, T)
    w = {"qk": model.qk_bank.unbind(0), "vo": model.vo_bank.unbind(0)}
    mlp = model.mlp_bank.unbind(0)
    ve_of = {1: 0, 2: 1, 8: 2, 9: 3}
    g_x0 = {i: pre[:, 18 + 2 * i: 19 + 2 * i] for i in range(4)}
    g_big = {i: pre[:, 19 + 2 * i: 20 + 2 * i] for i in range(4)}
    coefs.update({("xsa", 1): pre[:, 0:6], ("xsa", 3): pre[:, 6:12], ("gate", 3): pre[:, 12:18]})
    for i in range(11):
        if i == 4:
            post = gate(1, x, 41)
            for n, j in enumerate((4, 5, 7, 8, 9)):
                g_x0[j], g_big[j] = post[:, 18 + 2 * n: 19 + 2 * n], post[:, 19 + 2 * n: 20 + 2 * n]
            coefs.update({("xsa", 4): post[:, 0:6], ("xsa", 7): post[:, 6:12], ("gate", 10): post[:, 12:18],
                          ("dc_w1", 10): post[:, 29:35], ("dc_w2", 10): post[:, 35:41]})
        if i == 6:
            x = x + torch.sigmoid(s[23]).bfloat16() * post[:, 28:29] * cache[3]
        elif i != 10:
            src = cache[7] if i >= 8 else x
            att = model._attention(i, tg.norm(src), ve[ve_of[i]] if i in ve_of else None, None, None,
                                   doc, rope, masks, coef, w)
            x = resid[i, 0] * x + postl[i, 0] * att + x0 * g_x0[i]
            if i != 0:
                x = x + g_big[i] * xb
        else:
            cache[9] = x
            mu = layer(0, x, 14)
            m = [mu[:, c: c + 1] for c in range(14)]
            v_mudd = (m[0] * cache[0] + m[1] * cache[7] + m[2] * x).view(T, H, hd)
            x = (1 + m[5]) * x + m[3] * cache[0] + m[4] * cache[7]
            g_ve = torch.cat([m[6]] * 3 + [m[7]] * 3, dim=1)
            att = model._attention(10, tg.norm(cache[7]), ve[4], g_ve, v_mudd, doc, rope, masks, coef, w)
            x = m[8] * x + m[9] * att + m[10] * cache[0]
            x = x + m[11] * xb
        out = tg.triton_kernels.relu2_mlp(tg.norm(x), mlp[2 * i], mlp[2 * i + 1])  # the fused MLP kernel, tested on its own
        x = m[12] * x + m[13] * out if i == 10 else resid[i, 1] * x + postl[i, 1] * out
        if i in (3, 7):
            cache[i] = x
    m = layer(1, x, 5)
    x = x + m[:, 0:1] * cache[0] + m[:, 1:2] * cache[7] + m[:, 2:3] * cache[9] + m[:, 3:4] * ve[0] + m[:, 4:5] * cache[3]
    return tg.norm(x)


def test_forward_follows_the_records_section_1_5():
    """The table-driven forward equals the record's order of operations with its literal indices, on
    random parameters (every MUDD coefficient per token and non-zero)."""
    model = make_model(RECORD_SMALL)
    randomize(model, seed=3)
    with torch.no_grad():
        model._mudd_gate_scale.fill_(0.3)
    T = 256
    inputs, _, cu = make_batch(T=T, starts=(0, 60, 61, 200), vocab=1000)
    big = tg.bigram_hash(inputs, RECORD_SMALL.ngram_rows)
    with torch.no_grad():
        got = tg.final_hidden(model, inputs, cu, big)
        want = record_forward(model, inputs, cu, big)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_mudd_at_init_reduces_to_a_plain_last_layer_and_backout():
    """Section 1.9's "reduces to": at init, layer 10 is a normal layer (VE gate 2, resid 1.046875, x0
    gate 0, bigram gate 0.05) and the post-loop step is x - 0.5 h7. Checked through the coefficients the
    forward reads: MUDD layer outputs do not depend on the input at init."""
    model = make_model(RECORD_SMALL)
    T = 128
    inputs, _, cu = make_batch(T=T, vocab=1000)
    big = tg.bigram_hash(inputs, RECORD_SMALL.ngram_rows)
    seen = []
    original = model._mudd_layer
    model._mudd_layer = lambda k, x: seen.append((k, x)) or original(k, x)
    with torch.no_grad():
        tg.final_hidden(model, inputs, cu, big)
    (k0, x10), (k1, xend) = seen
    assert (k0, k1) == (0, 1)
    mu = original(0, x10)
    assert (mu[:, :6] == 0).all() and (mu[:, 10] == 0).all()  # no V, cache0, h mixing; x0 gate 0
    assert (mu[:, 6:8] == 2).all() and (mu[:, [8, 12]] == 1.046875).all() and (mu[:, [9, 13]] == 1).all()
    m = original(1, xend)
    assert (m[:, 1] == -0.5).all() and (m[:, [0, 2, 3, 4]] == 0).all()


def _v_seen_by_attention(model, layer, lam, w_v, ve_value, aux_value):
    """V as layer `layer`'s attention receives it, for a one-hot input xn = e_0: W_V[:, 0] = w_v, the
    QKV lambda lam, every value-embedding entry ve_value (gate 1) and MUDD's V aux_value."""
    T, D = 128, model.args.model_dim
    with torch.no_grad():
        model.scalars[2 * layer] = lam
        j = model.attn_index[layer]
        model.vo_bank[2 * j].zero_()
        model.vo_bank[2 * j][:, 0] = w_v
    xn = torch.zeros(T, D, dtype=torch.bfloat16)
    xn[:, 0] = 1
    seen = []
    model._attend = lambda q, k, v, mask, paired, chain="long": seen.append(v) or v
    cu = torch.tensor([0] + [T] * 7, dtype=torch.int32)
    ve = torch.full((T, D), ve_value, dtype=torch.bfloat16)
    gate = torch.ones(T, model.args.num_heads, dtype=torch.bfloat16)
    aux = torch.full((T, model.args.num_heads, D // model.args.num_heads), aux_value, dtype=torch.bfloat16)
    rope = {"long": tg.rotary_tables(model.rotary_freq, T, model.args.num_heads, torch.bfloat16)}
    w = {"qk": model.qk_bank.unbind(0), "vo": model.vo_bank.unbind(0)}
    coef = lambda kind, i: torch.ones(T, model.args.num_heads, dtype=torch.bfloat16)  # noqa: E731
    with torch.no_grad():
        model._attention(layer, xn, ve, gate, aux, tg.document_ids(cu, T), rope, model.attention_masks(cu, T), coef, w)
    return seen[0].float()


def test_layer_10_value_sum_and_qkv_lambda_follow_the_records_rounding():
    """bf16 rounding tells the orders apart. Layer 10's V is v + (g ve + MUDD's V) (record section 1.5):
    1 + (2^-8 + 2^-8) = 1 + 2^-7 is a bf16 number, while (1 + 2^-8) rounds back to 1 first (a tie to
    even). The QKV lambda scales the bf16 weights in fp32 (record section 1.6): 3 x 0.333 = 0.999 rounds
    to 1.0, while 3 x bf16(0.333) = 0.99609375."""
    model = make_model(RECORD_SMALL)
    v = _v_seen_by_attention(model, 10, lam=1.0, w_v=1.0, ve_value=2.0 ** -8, aux_value=2.0 ** -8)
    assert (v == 1 + 2.0 ** -7).all()
    v = _v_seen_by_attention(model, 10, lam=0.333, w_v=3.0, ve_value=0.0, aux_value=0.0)
    assert (v == 1.0).all()


def test_mudd_layer_outputs_are_read_by_the_records_indices():
    """Section 1.5 / 1.9: layer 10's 14 coefficients mu0..mu13 and the post-loop 5, by name."""
    assert tg.MUDD_LAYER_NAMES[0] == (
        "v_cache0", "v_h", "v_x",            # mu0-2: v_mudd = mu0 cache0 + mu1 h7 + mu2 x
        "x_cache0", "x_h", "x_gain",         # mu3-5: x <- (1 + mu5) x + mu3 cache0 + mu4 h7
        "ve_gate_first_half", "ve_gate_second_half",  # mu6, mu7: VE gate [mu6] x 3 + [mu7] x 3
        "resid_attn", "post_attn", "x0",     # mu8-10: x <- mu8 x + mu9 a + mu10 cache0
        "bigram",                            # mu11
        "resid_mlp", "post_mlp")             # mu12, mu13: x <- mu12 x + mu13 MLP(norm(x))
    assert tg.MUDD_LAYER_NAMES[1] == ("cache0", "h", "mudd_input", "ve0", "skip_source")  # m0..m4 (section 1.5, step 9)
    model = make_model(RECORD_SMALL)
    b = model.mudd_b2.detach().float() / 10  # stored x10 (section 1.9)
    assert b[0, 6] == b[0, 7] == 2.0 and b[0, 9] == b[0, 13] == 1.0 and b[0, 11] == pytest.approx(0.05, rel=1e-2)
    assert b[0, 8] == b[0, 12] == pytest.approx(1.05, rel=1e-2) and b[1, 1] == -0.5
