"""The model: attention masks (dense and block-sparse), paired heads, YaRN, document isolation,
causality, losses against float64 references, gradients, parameter shapes and torch.compile."""
import dataclasses
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

import train_gpt as tg
import triton_kernels as tk

TEST = tg.parse_args(["--preset", "test"])


def make_batch(T=128, starts=(0, 30, 70, 100), pad_to=8, seed=0, vocab=50257):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (T + 1,), generator=g)
    cu = torch.tensor(list(starts) + [T] * (pad_to - len(starts)), dtype=torch.int32)
    return tokens[:-1].clone(), tokens[1:].clone(), cu


def bigrams(inputs, args=TEST):
    return tg.bigram_hash(inputs, args.ngram_rows)


@torch.no_grad()
def randomize(model: tg.GPT, seed=0):
    """Give every parameter generic non-zero values (zero inits would hide paths), padding excluded."""
    g = torch.Generator().manual_seed(seed)
    D = model.args.model_dim

    def rnd(p, std):  # drawn on the CPU (one stream for any device), then moved to the parameter's
        p.copy_((std * torch.randn(p.shape, generator=g)).to(device=p.device, dtype=p.dtype))

    for name in ("qk_bank", "vo_bank", "mlp_bank"):
        bank = getattr(model, name)
        rnd(bank, 0.5 / math.sqrt(D))
        for idx, role in enumerate(model.bank_roles[name]):
            if role == "pad":
                bank[idx].zero_()
    rnd(model.lm_head, 0.3)
    rnd(model.embed, 0.05)
    rnd(model.value_embeds, 0.5)
    rnd(model.bigram_embed, 0.5)
    for p in (model.scalars, model.resid_lambdas, model.post_lambdas):
        p.copy_((0.3 + 0.7 * torch.rand(p.shape, generator=g)).to(p.device))
    for p in (model.ve_gate_bank, model.smear_gate):
        rnd(p, 0.5)
    for p in (model.mudd_w2, model.mudd_gate_w2):  # per-token MUDD coefficients around their biases
        rnd(p, 0.5)
    for p in (model.mudd_b2, model.mudd_gate_b2):
        p.add_((0.5 * torch.randn(p.shape, generator=g)).to(device=p.device, dtype=p.dtype))


def make_model(args=TEST, world_size=1, seed=0):
    torch.manual_seed(seed)
    return tg.GPT(args, world_size)


# ---- masks -------------------------------------------------------------------------------------


def brute_force_mask(doc_of_token, window, pos_div):
    """The record's rule in slots: causal, at most `window` slots back (window + 1 keys), same document
    (slot s belongs to token s // pos_div)."""
    n = len(doc_of_token) * pos_div
    m = np.zeros((n, n), dtype=bool)
    for qs in range(n):
        for ks in range(n):
            m[qs, ks] = ks <= qs and qs - ks <= window and doc_of_token[qs // pos_div] == doc_of_token[ks // pos_div]
    return torch.from_numpy(m)


def random_layout(rng, T):
    cuts = sorted(rng.choice(np.arange(1, T), size=rng.integers(0, 6), replace=False).tolist())
    starts = [0] + cuts
    doc = np.zeros(T, dtype=np.int64)
    for i, s in enumerate(starts):
        doc[s:] = i
    cu = torch.tensor(starts + [T] * (8 - len(starts)), dtype=torch.int32)
    return doc, cu


@pytest.mark.parametrize("seed", range(6))
def test_dense_mask_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    T = 48
    doc, cu = random_layout(rng, T)
    ids = tg.document_ids(cu, T)
    assert ids.tolist() == doc.tolist()
    for window in (1, 5, 17, 100):
        for pos_div in (1, 2):
            got = tg.dense_attention_mask(ids, torch.tensor(window, dtype=torch.int32), pos_div)
            assert torch.equal(got, brute_force_mask(doc, window, pos_div)), (window, pos_div)


def as_flex_kernel_reads(indices):
    """A block-index tensor as flex_attention's Triton kernels read it: they take the strides of the
    batch, head and row dims and step through a row's indices one element at a time (stride 1)."""
    return indices.as_strided(indices.shape, (*indices.stride()[:-1], 1))


def expand_block_mask(bm, n, bs):
    """Token-level mask the flex kernel would apply: partial blocks run mask_mod, full blocks pass."""
    idx = torch.arange(n)
    mod = bm.mask_mod(0, 0, idx[:, None], idx[None, :])
    out = torch.zeros(n, n, dtype=torch.bool)
    nb = n // bs
    partial = torch.zeros(nb, nb, dtype=torch.bool)
    full = torch.zeros(nb, nb, dtype=torch.bool)
    for i in range(nb):
        for j in as_flex_kernel_reads(bm.kv_indices)[0, 0, i, : bm.kv_num_blocks[0, 0, i]].tolist():
            partial[i, j] = True
        for j in as_flex_kernel_reads(bm.full_kv_indices)[0, 0, i, : bm.full_kv_num_blocks[0, 0, i]].tolist():
            full[i, j] = True
    assert not (partial & full).any()
    for i in range(nb):
        for j in range(nb):
            rows, cols = slice(i * bs, (i + 1) * bs), slice(j * bs, (j + 1) * bs)
            if full[i, j]:
                out[rows, cols] = True
            elif partial[i, j]:
                out[rows, cols] = mod[rows, cols]
    return out, full


@pytest.mark.parametrize("seed", range(5))
def test_block_mask_applies_exactly_the_dense_mask(seed):
    rng = np.random.default_rng(100 + seed)
    T, bs = 96, 16
    doc, cu = random_layout(rng, T)
    ids = tg.document_ids(cu, T)
    # 15, 47 (1, 16): a block pair's largest (smallest) slot distance lands exactly on the window edge
    for window in (1, 2, 15, 16, 17, 40, 47, 1000):
        for pos_div in (1, 2):
            w = torch.tensor(window, dtype=torch.int32)
            bm = tg.block_attention_mask(ids, w, pos_div, block_size=bs)
            expected = brute_force_mask(doc, window, pos_div)
            effective, full = expand_block_mask(bm, T * pos_div, bs)
            assert torch.equal(effective, expected), (window, pos_div)
            # full blocks are exactly those where every pair passes (the kernel's fast path is used)
            nb = T * pos_div // bs
            all_pass = expected.view(nb, bs, nb, bs).all(3).all(1)
            assert torch.equal(full, all_pass)
            # the query side (the backward's loop over query blocks per key block): the same block
            # pairs, each key block's query blocks listed first in ascending order, laid out as the
            # backward kernel reads them (a transposed layout read with stride 1 gave wrong dk/dv on CUDA)
            partial = expected.view(nb, bs, nb, bs).any(3).any(1) & ~all_pass
            for num, idx, want in ((bm.q_num_blocks, bm.q_indices, partial), (bm.full_q_num_blocks,
                                                                              bm.full_q_indices, all_pass)):
                for j in range(nb):
                    listed = as_flex_kernel_reads(idx)[0, 0, j, : num[0, 0, j]].tolist()
                    assert listed == torch.nonzero(want[:, j]).flatten().tolist(), (window, pos_div, j)


def test_block_mask_rejects_ragged_length():
    with pytest.raises(ValueError, match="multiple of"):
        tg.block_attention_mask(torch.zeros(100, dtype=torch.int64), torch.tensor(8), 1, block_size=16)


@pytest.mark.parametrize("pos_div", [1, 2])
def test_flex_forward_equals_sdpa_dense_forward(pos_div):
    rng = np.random.default_rng(7)
    T, bs, H, hd = 64, 16, 2, 16
    doc, cu = random_layout(rng, T)
    ids = tg.document_ids(cu, T)
    w = torch.tensor(24, dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, T * pos_div, hd, generator=g) for _ in range(3))
    bm = tg.block_attention_mask(ids, w, pos_div, block_size=bs)
    y_flex = flex_attention(q, k, v, block_mask=bm, scale=0.3)
    y_sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=tg.dense_attention_mask(ids, w, pos_div), scale=0.3)
    torch.testing.assert_close(y_flex, y_sdpa, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pos_div", [1, 2])
@pytest.mark.parametrize("seed", range(3))
def test_banded_attention_equals_dense_sdpa_forward_and_backward(pos_div, seed):
    """The CPU attention's banded form (each band of queries sees only its own keys and `span` before
    them) gives the dense-mask result in float64, values and gradients, including windows that end
    exactly on a band edge and documents that cross bands."""
    rng = np.random.default_rng(200 + seed)
    T, H, hd = 96, 2, 8
    doc, cu = random_layout(rng, T)
    ids = tg.document_ids(cu, T)
    g = torch.Generator().manual_seed(seed)
    for window, chunk in ((1, 16), (7, 16), (16, 16), (33, 32), (40, 8)):
        span = window  # the window counts slots: a query sees at most `window` slots back
        w = torch.tensor(window, dtype=torch.int32)
        q, k, v = (torch.randn(1, H, T * pos_div, hd, generator=g, dtype=torch.float64, requires_grad=True)
                   for _ in range(3))
        mask = tg.banded_attention_mask(ids, w, pos_div, chunk, span)
        assert mask.shape == (T * pos_div // chunk, 1, chunk, chunk + span)
        got = tg.banded_attention(q, k, v, mask, span)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=tg.dense_attention_mask(ids, w, pos_div), scale=1.0)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        dy = torch.randn(got.shape, generator=g, dtype=torch.float64)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), dy), torch.autograd.grad(want, (q, k, v), dy)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_attention_band_only_where_it_saves_work():
    assert tg.attention_band(6144, 1664) == tg.CPU_ATTENTION_CHUNK
    assert tg.attention_band(6144 + 128, 64) == tg.CPU_ATTENTION_CHUNK // 2   # largest chunk dividing n
    assert tg.attention_band(1024, 832) == 0     # band as wide as the sequence: dense
    assert tg.attention_band(100, 4) == 0        # no chunk divides n: dense


def test_model_with_banded_cpu_attention_equals_dense(monkeypatch):
    """A whole forward and backward at a length where the CPU path bands its attention (paired and
    unpaired layers, short and long windows) matches the same model forced onto dense masks. In fp32 (the
    bands are the same in any dtype) the two agree to fp32 rounding: bounds 100x tighter than bf16's, in a
    seventh of bf16's time on a CPU without bf16 units. A window one slot wider in the bands fails them."""
    args = dataclasses.replace(TEST, window_block_size=32)
    torch.manual_seed(0)
    model = tg.GPT(args, dtype=torch.float32)
    randomize(model, seed=11)
    model.set_windows(2, 5)
    T = 1024
    inputs, targets, cu = make_batch(T=T, starts=(0, 100, 450, 900))
    big = bigrams(inputs)
    assert tg.attention_band(2 * T, 2 * 32) and tg.attention_band(T, 5 * 32)  # paired rows: short windows

    def run():
        model.zero_grad(set_to_none=True)
        loss, _ = model(inputs, targets, cu, big, mtp_weights=torch.tensor([1.0, 0.5, 0.25]), loss_scale=1 / T)
        loss.backward()
        return loss.detach(), model.qk_bank.grad.float(), model.vo_bank.grad.float()

    banded = run()
    monkeypatch.setattr(tg, "attention_band", lambda n, span: 0)
    dense = run()
    assert abs(banded[0].item() - dense[0].item()) < 1e-5
    for a, b in zip(banded[1:], dense[1:]):
        assert (a - b).norm() / b.norm() < 1e-4


# ---- attention semantics -------------------------------------------------------------------------


def documented_varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size):
    """torch.nn.attention.varlen.varlen_attn as its documentation states it, in float64 loops: the
    rows [cu[i], cu[i+1]) of (n, H, hd) q, k, v are one sequence each (empty ones allowed); a query at
    row t sees the keys u of its sequence with t - left <= u <= t + right (window_size=(W, 0): causal,
    W back); max_q / max_k bound every sequence's length (the flash kernel's launch grid)."""
    assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k and cu_seq_q.dtype == torch.int32
    left, right = window_size
    out = torch.zeros_like(q)
    bounds = cu_seq_q.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        assert 0 <= b - a <= max_q, (a, b, max_q)
        for t in range(a, b):
            for h in range(q.shape[1]):
                keys = [u for u in range(a, b) if t - left <= u <= t + right]
                p = torch.softmax(torch.tensor([scale * float(q[t, h] @ k[u, h]) for u in keys], dtype=torch.float64), 0)
                out[t, h] = p @ v[keys, h].double()
    return out


@pytest.mark.parametrize("kernel", ["sdpa", "flex", "varlen"])
@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("heads,widths", [(2, (8, 8)), (6, (8, 8)), (6, (4, 8)), (2, (4, 4))])
def test_attend_matches_float64_brute_force(paired, heads, widths, kernel, monkeypatch):
    """A loop over tokens and heads. Paired (the record's slots): head h of token t is slot
    2t + h // (H/2); head h attends over heads h mod H/2 and h mod H/2 + H/2 of earlier slots, at most
    `window` slots back, so a first-half head does not see its partner of the same token. The scores
    are scaled by the model's fp32 softmax scale (stage 2's: 0.116946 at head_dim 128). widths: (q and k,
    v) per head; record #92's narrow rows have q and k half as wide as v, or both halved."""
    model = make_model()
    model.set_windows(*model.args.stages[1].windows)
    scale = model.attn_scale_value
    assert scale == float(model.attn_scale) and model.attn_scale.dtype == torch.float32
    (T, H), (qk_width, hd) = (64, heads), widths
    doc = torch.tensor([0] * 15 + [1] * 49)
    window = torch.tensor(11, dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(T, H, width, generator=g, dtype=torch.float64) for width in (qk_width, qk_width, hd))
    cu = torch.tensor([0, 15, 64, 64], dtype=torch.int32)
    if kernel == "flex":  # the GPU's block mask, through flex_attention's eager reference (no CPU backward)
        mask = tg.block_attention_mask(tg.document_ids(cu, T), window, 2 if paired else 1, block_size=16)
    elif kernel == "varlen":  # the CUDA kernel's documented semantics standing in for it (it has no CPU kernel)
        import torch.nn.attention.varlen as varlen_module
        monkeypatch.setattr(varlen_module, "varlen_attn", documented_varlen_attn)
        model.window_tokens = (11, 11)
        mask = model.attention_masks(cu, T, kernel="varlen", max_doc_len=49)[(False, 2) if paired else (True, 1)]
        assert isinstance(mask, tg.VarlenMask) and mask.window == 11 and mask.max_seqlen == 49 * (2 if paired else 1)
    else:
        mask = tg.attention_mask(doc, window, 11, 2 if paired else 1, "sdpa")
    with torch.no_grad():
        got = model._attend(q, k, v, mask, paired=paired)
    want = torch.zeros(T, H, hd, dtype=torch.float64)
    half = H // 2
    for t in range(T):
        for h in range(H):
            if paired:
                qs = 2 * t + h // half
                pairs = [(s // 2, (s % 2) * half + h % half) for s in range(qs + 1)
                         if qs - s <= 11 and doc[s // 2] == doc[t]]
            else:
                pairs = [(s, h) for s in range(t + 1) if t - s <= 11 and doc[s] == doc[t]]
            logits = torch.tensor([scale * float(q[t, h] @ k[s, hk]) for s, hk in pairs], dtype=torch.float64)
            p = torch.softmax(logits, 0)
            want[t, h] = p @ torch.stack([v[s, hk] for s, hk in pairs])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # flex's eager reference scales in fp32


def test_softmax_scale_is_the_fp32_value_not_bf16():
    """Record #89 hands the fp32 scale to the attention kernel: stage 2's 0.116946, not bf16's 0.11719 (a
    0.2% sharper softmax). Brute force at both scales: the model's output matches only the fp32 one."""
    model = make_model(dataclasses.replace(TEST, head_dim=128, model_dim=256))
    model.set_windows(*model.args.stages[1].windows)
    scale = model.attn_scale_value
    assert scale == pytest.approx(0.116946, abs=1e-6)
    rounded = float(torch.tensor(scale).bfloat16())
    assert rounded == 0.1171875
    T, H, hd = 32, 2, 128
    g = torch.Generator().manual_seed(2)
    q, k, v = (3 * torch.randn(T, H, hd, generator=g, dtype=torch.float64) for _ in range(3))
    doc = torch.zeros(T, dtype=torch.int64)
    got = model._attend(q, k, v, tg.attention_mask(doc, torch.tensor(T, dtype=torch.int32), T, 1, "sdpa"), paired=False)

    def brute(s):
        logits = s * torch.einsum("thd,uhd->htu", q, k)
        logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("htu,uhd->thd", logits.softmax(-1), v)

    assert (got - brute(scale)).abs().max() < 1e-12
    assert (got - brute(rounded)).abs().max() > 1e-4


def test_document_isolation_is_bit_exact():
    """Attention never crosses a document start. The smear and the bigram hash do (the record's): a
    document's last token reaches the next document's first position, and through it that document.
    So does the key offset (test_key_offset_crosses_documents); it is off here."""
    model = make_model(tg.ablated(TEST, ["key_offset"]))
    randomize(model)
    inputs, _, cu = make_batch()  # documents [0, 30), [30, 70), [70, 100), [100, 128)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        base = tg.bf16_logits(model, inputs, cu, bigrams(inputs))
        changed = inputs.clone()
        changed[30:69] = torch.randint(0, 50257, (39,), generator=gen)  # all of document 2 but its last token
        out = tg.bf16_logits(model, changed, cu, bigrams(changed))
        others = torch.cat([torch.arange(0, 30), torch.arange(70, 128)])
        assert torch.equal(out[others], base[others])
        assert not torch.allclose(out[30:70], base[30:70])
        last = inputs.clone()
        last[69] = (inputs[69] + 1) % 50257  # only document 2's last token
        out = tg.bf16_logits(model, last, cu, bigrams(last))
    assert torch.equal(out[:69], base[:69]) and torch.equal(out[100:], base[100:])
    assert not torch.allclose(out[70], base[70])  # the documented one-token look-back


def test_causality_is_bit_exact():
    model = make_model()
    randomize(model, seed=3)
    inputs, _, cu = make_batch(starts=(0, 90))
    t = 50
    with torch.no_grad():
        base = tg.bf16_logits(model, inputs, cu, bigrams(inputs))
        changed = inputs.clone()
        changed[t] = (changed[t] + 1) % 50257
        out = tg.bf16_logits(model, changed, cu, bigrams(changed))
    assert torch.equal(out[:t], base[:t])
    assert not torch.allclose(out[t], base[t])
    assert not torch.allclose(out[t + 5], base[t + 5])  # later positions of the document do see it


def test_windows_limit_what_attention_sees():
    """A token further back than every window (and the skip/smear paths) cannot change the output."""
    model = make_model()
    randomize(model, seed=4)
    inputs, _, cu = make_batch(starts=(0,))
    model.set_windows(1, 2)  # 16 slots (8 tokens) on the paired layer 0, 32 tokens on layers 1 and 3
    with torch.no_grad():
        base = tg.bf16_logits(model, inputs, cu, bigrams(inputs))
        changed = inputs.clone()
        changed[0] = (changed[0] + 7) % 50257
        out = tg.bf16_logits(model, changed, cu, bigrams(changed))
    # reach: 8 + 2 * (32 + 1 key offset) tokens, + 1 smear + 1 bigram = 76 (layer 2 has no attention)
    assert torch.equal(out[80:], base[80:])
    assert not torch.allclose(out[:40], base[:40])


# ---- YaRN ----------------------------------------------------------------------------------------


def yarn_step64(freq, scale, old, new):
    """The record's YaRN rule, written out in float64 from its description."""
    out = []
    for f in freq:
        r = old * f / (2 * math.pi)
        w = min(max((r - 1) / 31, 0.0), 1.0)
        out.append(f * (old / new + w * (1 - old / new)))
    return out, scale * (1 + 0.2 * math.log(new / old))


def test_yarn_frequencies_after_384_to_896_tokens():
    """Speedrun shapes: the first stage change (long window 3 -> 7 blocks of 128) against float64."""
    two_layers = tg.layers_from_words(("attn short ve save_skip save_h", "attn long from_h mudd post_gates"))
    model = make_model(dataclasses.replace(tg.Hyperparameters(), layers=two_layers,
                                           mlp_hidden=64, padded_vocab_size=50304, ngram_rows=64))
    base = [1024 ** (-j / 31) for j in range(32)]  # omega_j = 1024^(-j/31): 1 down to 1/1024
    torch.testing.assert_close(model.rotary_freq.double(), torch.tensor(base, dtype=torch.float64), rtol=1e-6, atol=0)
    assert model.attn_scale.item() == pytest.approx(0.1, rel=1e-7)
    model.set_windows(3, 7)
    freq, scale = yarn_step64(base, 0.1, 384, 896)
    torch.testing.assert_close(model.rotary_freq.double(), torch.tensor(freq, dtype=torch.float64), rtol=1e-6, atol=0)
    assert model.attn_scale.item() == pytest.approx(scale, rel=1e-6)
    assert model.windows.tolist() == [3 * 128, 7 * 128]
    # both regimes occur: fast frequencies kept, slow ones divided by 896/384
    assert freq[0] == base[0] and freq[-1] == pytest.approx(base[-1] * 384 / 896)


def test_attention_scale_per_stage_and_final_validation():
    """The record's table: 0.1, 0.116946, 0.127518, 0.131778, compounding on the long window; the final
    validation's wider window (20 blocks) keeps the extension's YaRN state."""
    args = tg.Hyperparameters()
    two_layers = tg.layers_from_words(("attn short ve save_skip save_h", "attn long from_h mudd post_gates"))
    model = make_model(dataclasses.replace(args, layers=two_layers, mlp_hidden=64, ngram_rows=64))
    freq64, scale64 = [1024 ** (-j / 31) for j in range(32)], 0.1
    old = 3
    for step, expected in ((0, 0.1), (423, 0.116946), (847, 0.127518), (1270, 0.131778)):
        short, long = tg.plan_step(args, step).windows
        model.set_windows(short, long)
        if long != old:
            freq64, scale64 = yarn_step64(freq64, scale64, old * 128, long * 128)
            old = long
        assert model.attn_scale.item() == pytest.approx(expected, abs=5e-7)
        assert scale64 == pytest.approx(expected, abs=5e-7)
        torch.testing.assert_close(model.rotary_freq.double(), torch.tensor(freq64, dtype=torch.float64), rtol=2e-6, atol=0)
    ext = model.rotary_freq.clone()
    model.set_windows(*args.final_val_windows, yarn_blocks=13)
    assert model.windows.tolist() == [6 * 128, 20 * 128]
    assert torch.equal(model.rotary_freq, ext) and model.attn_scale.item() == pytest.approx(0.131778, abs=5e-7)
    model.set_windows(1, 3)  # back to the start (warm-up restore): exactly the base state
    assert model.attn_scale.item() == pytest.approx(0.1, rel=1e-7)


def test_set_windows_rejects_bad_values():
    model = make_model()
    with pytest.raises(ValueError, match="block count"):
        model.set_windows(0, 3)
    with pytest.raises(ValueError, match="block count"):
        model.set_windows(1, 2.5)


# ---- losses and gradients ------------------------------------------------------------------------


def test_forward_backward_at_init():
    model = make_model()
    inputs, targets, cu = make_batch()
    T = inputs.numel()
    V = TEST.padded_vocab_size
    w = torch.tensor([1.0, 0.5, 0.25])
    loss, _ = model(inputs, targets, cu, bigrams(inputs), mtp_weights=w, loss_scale=1.0 / T)
    loss.backward()
    assert torch.isfinite(loss)
    # near-zero logits: every term is about ln(V); the last positions lack their t+2 / t+3 terms
    expected = math.log(V) * (T + 0.5 * (T - 1) + 0.25 * (T - 2)) / T
    assert loss.item() == pytest.approx(expected, abs=0.02)
    with torch.no_grad():
        assert model(inputs, targets, cu, bigrams(inputs)).item() == pytest.approx(math.log(V), abs=0.01)
    # exactly-zero gradients at init come only from the documented zero inits
    grads = {label: p.grad for label, p in model.params_by_label().items()}
    # (the smear gate's output is scaled by a zero lambda; MUDD's first layers feed zero second layers;
    # the MLP up-projections and the MLP's post lambdas feed zero down-projections)
    zero_at_init = {"smear_gate", "mudd_w1", "mudd_gate_w1"}
    for label, g in grads.items():
        assert g is not None, label
        assert (g.abs().sum() == 0) == (label in zero_at_init), label
    assert (grads["post_lambdas"][:, 1] == 0).all() and (grads["post_lambdas"][:, 0] != 0).any()
    roles = model.bank_roles
    for idx, role in enumerate(roles["vo_bank"]):  # V and O are drawn, so every real one learns from step 0
        assert (grads["vo_bank"][idx].abs().sum() > 0) == (role != "pad"), role
    for idx, role in enumerate(roles["mlp_bank"]):
        assert (grads["mlp_bank"][idx].abs().sum() > 0) == role.startswith("down."), role


def test_cpu_training_loss_fuses_the_head_and_gives_the_unfused_gradients(monkeypatch):
    """On a CPU the training forward runs the head's matmuls inside the loss (no (T, V) logits): its
    loss and every parameter's gradient are those of the unfused head, hidden @ lm_head, with the loss."""
    model = make_model()
    randomize(model)
    inputs, targets, cu = make_batch()
    w, T = torch.tensor([1.0, 0.5, 0.25]), inputs.numel()
    prefix = torch.tensor(0.25)
    hidden = tg.final_hidden(model, inputs, cu, bigrams(inputs))
    prefix_ids = model.prefix_table[targets.long()]
    want = tk.softcapped_ce_mtp(hidden @ model.lm_head, targets, w, prefix_ids, prefix, grad_scale=1 / T).sum() / T
    want.backward()
    want_grads = {label: p.grad.clone() for label, p in model.params_by_label().items()}
    model.zero_grad(set_to_none=True)

    def unfused(*a, **k):
        raise AssertionError("the CPU training forward built the (T, V) logits")
    monkeypatch.setattr(tk, "softcapped_ce_mtp", unfused)
    loss, _ = model(inputs, targets, cu, bigrams(inputs), mtp_weights=w, loss_scale=1 / T, prefix_weight=prefix)
    loss.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    for label, p in model.params_by_label().items():
        g, e = p.grad.double(), want_grads[label].double()
        assert (g - e).abs().max() <= 1e-5 * e.abs().max() + 1e-12, label


def test_every_parameter_gets_a_gradient():
    model = make_model(world_size=4)  # padding: qk/vo 6 -> 8, mlp 8 -> 8
    assert model.bank_roles["qk_bank"][-2:] == ["pad", "pad"]
    randomize(model)
    inputs, targets, cu = make_batch()
    model(inputs, targets, cu, bigrams(inputs), mtp_weights=torch.tensor([1.0, 0.5]), loss_scale=0.01)[0].backward()
    # entries that are never read (as in the record) are exactly those without gradient: the skip row's
    # attention lambdas, the mudd row's lambdas (MUDD mixes instead) and VE gate, the scalars' padding,
    # the unused outputs of the smaller MUDD layer / gate
    L, skip_row, mudd_row = 4, 2, 3
    dead = {name: torch.zeros(getattr(model, name).shape, dtype=torch.bool)
            for name in ("scalars", "resid_lambdas", "post_lambdas", "ve_gate_bank", "mudd_w2", "mudd_b2",
                         "mudd_gate_w2", "mudd_gate_b2")}
    dead["scalars"][2 * skip_row: 2 * skip_row + 2] = True
    dead["scalars"][2 * L + 2:] = True
    for name in ("resid_lambdas", "post_lambdas"):
        dead[name][skip_row, 0] = True
        dead[name][mudd_row] = True
    dead["ve_gate_bank"][model.ve_index[mudd_row]] = True
    dead["mudd_w2"][1, 5:] = dead["mudd_b2"][1, 5:] = True
    for k, n in enumerate(model.gate_outputs):
        dead["mudd_gate_w2"][k, n:] = dead["mudd_gate_b2"][k, n:] = True
    assert model.gate_outputs == (2, 13) and dead["scalars"].sum() == 8
    for label, p in model.params_by_label().items():
        assert p.grad is not None and p.grad.dtype == p.dtype, label
        if label in model.bank_roles:
            for idx, role in enumerate(model.bank_roles[label]):
                nz = p.grad[idx].abs().sum() > 0
                assert nz == (role != "pad"), (label, role)
        elif label in dead:
            assert torch.equal(p.grad != 0, ~dead[label]), (label, p.grad)
        elif label in ("value_embeds", "ve_gate_bank"):
            assert all(p.grad[j].abs().sum() > 0 for j in range(p.shape[0])), label
        else:
            assert p.grad.abs().sum() > 0, label


@pytest.mark.parametrize("chunk", [8192, 48])  # one chunk; several chunks and a remainder
def test_eval_loss_equals_independent_cross_entropy(chunk, monkeypatch):
    monkeypatch.setattr(tg, "EVAL_CHUNK_TOKENS", chunk)
    model = make_model()
    randomize(model, seed=2)
    inputs, targets, cu = make_batch(seed=1)
    with torch.no_grad():
        loss = model(inputs, targets, cu, bigrams(inputs))
        z = tg.bf16_logits(model, inputs, cu, bigrams(inputs)).double()
    assert z.dtype == torch.float64 and z.shape == (128, TEST.padded_vocab_size)
    ref = (torch.logsumexp(z, 1) - z[torch.arange(128), targets]).mean()
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert loss.item() > math.log(TEST.padded_vocab_size) + 0.1  # randomised weights: not the trivial value


def test_eval_softcap_is_rounded_once_to_bf16_like_the_records():
    """Record #89 evaluates z = 23 sigmoid((l + 5) / 7.5) on its bf16 logits as one bf16 expression: the
    fp32 value rounded once to bf16, then cast to fp32 for the cross-entropy."""
    model = make_model()
    randomize(model, seed=2)
    inputs, _, cu = make_batch(seed=1)
    with torch.no_grad():
        raw = tg.final_hidden(model, inputs, cu, bigrams(inputs)) @ model.lm_head
        z = tg.bf16_logits(model, inputs, cu, bigrams(inputs))
    assert raw.dtype == torch.bfloat16 and z.dtype == torch.float32
    want = (23 * torch.sigmoid((raw.double() + 5) / 7.5)).float().bfloat16().float()
    assert (z != want).float().mean() < 1e-3  # fp32 sigmoid against float64: a rare neighbouring value
    assert torch.equal(z, z.bfloat16().float())  # bf16 values only


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_eval_loss_is_the_plain_formula_bit_for_bit(threads, monkeypatch):
    """The CPU evaluation computes the softcap and log-softmax in cache-sized blocks of rows
    (tk.softcap_log_probs): the loss must be the plain formula's, F.cross_entropy(softcap(logits)) per
    chunk, to the last bit, with one thread or several (several chunks and a remainder: 48 tokens each)."""
    monkeypatch.setattr(tg, "EVAL_CHUNK_TOKENS", 48)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = make_model()
        randomize(model, seed=3)
        inputs, targets, cu = make_batch(seed=4)
        with torch.no_grad():
            loss = model(inputs, targets, cu, bigrams(inputs))
            raw = tg.final_hidden(model, inputs, cu, bigrams(inputs)) @ model.lm_head
            total = torch.zeros((), dtype=torch.float32)
            for c in range(0, raw.shape[0], 48):
                total = total + F.cross_entropy(tk.softcap(raw[c:c + 48]), targets[c:c + 48].long(), reduction="sum")
    finally:
        torch.set_num_threads(old)
    assert raw.shape[0] % 48 and raw.shape[0] > 48
    assert loss.item() == (total / raw.shape[0]).item()


def record_training_loss_float64(model, inputs, targets, cu, weights, prefix_ids=None, prefix_weight=0.0):
    """Sum over tokens of the record's training loss (record #89) in float64 from the
    model's own head logits: MTP terms that stay inside the sequence, the prefix term where the target
    has a prefix token. z = 23 sigma with the kernels' bf16 sigma: its rounding is tested against float64
    in test_triton_kernels.py; here the bf16 logits take few distinct values, and one of them whose fp32
    sigma sits at a bf16 rounding midpoint would move thousands of logits together."""
    with torch.no_grad():
        raw = tg.final_hidden(model, inputs, cu, bigrams(inputs)) @ model.lm_head  # the training head (no FP8 on CPU)
    z = 23 * tk.softcap_sigma_bf16(raw).double()
    lse = torch.logsumexp(z, 1)
    T = z.shape[0]
    total = torch.zeros((), dtype=torch.float64)
    for k, wk in enumerate(weights):
        n = T - k
        total += wk * (lse[:n] - z[torch.arange(n), targets[k:]]).sum()
    if prefix_ids is not None:
        valid = prefix_ids >= 0
        total += prefix_weight * (lse - z[torch.arange(T), prefix_ids.clamp(min=0)])[valid].sum()
    return total.item()


def test_training_loss_is_scaled_sum_of_mtp_cross_entropies():
    model = make_model()
    randomize(model, seed=5)
    inputs, targets, cu = make_batch(seed=2)
    with torch.no_grad():
        loss, _ = model(inputs, targets, cu, bigrams(inputs), mtp_weights=torch.tensor([1.0, 0.5, 0.25]), loss_scale=0.125)
    ref = record_training_loss_float64(model, inputs, targets, cu, [1.0, 0.5, 0.25])
    assert loss.item() == pytest.approx(0.125 * ref, rel=1e-5)


def prefix_model(args=TEST, seed=5):
    model = make_model(args)
    randomize(model, seed=seed)
    model.prefix_table.copy_(tg.build_prefix_table(tg.gpt2_encoding(), args.padded_vocab_size))
    return model


def test_training_loss_adds_the_prefix_term():
    """The prefix term reads the model's prefix_table buffer (-1 until train() fills it, not saved in
    checkpoints); a weight of 0 (--ablate prefix_loss gives every stage row 0), or no prefix_weight,
    leaves the MTP terms alone."""
    assert (make_model().prefix_table == -1).all() and "prefix_table" not in make_model().state_dict()
    model = prefix_model()
    inputs, targets, cu = make_batch(seed=2)
    w, pi = [1.0, 0.5, 0.25], torch.tensor(0.25)
    prefix_ids = model.prefix_table[targets]
    assert (prefix_ids >= 0).sum() > 100  # random GPT-2 ids: nearly every one has a prefix token

    def loss_of(m, prefix_weight):
        with torch.no_grad():
            return m(inputs, targets, cu, bigrams(inputs), mtp_weights=torch.tensor(w), loss_scale=0.125,
                     prefix_weight=prefix_weight)[0].item()

    with_prefix = loss_of(model, pi)
    expected = record_training_loss_float64(model, inputs, targets, cu, w, prefix_ids, 0.25)
    assert with_prefix == pytest.approx(0.125 * expected, rel=1e-5)
    without = 0.125 * record_training_loss_float64(model, inputs, targets, cu, w)
    assert with_prefix - without > 1.0  # the term is there
    assert loss_of(model, None) == pytest.approx(without, rel=1e-5)
    assert loss_of(model, torch.tensor(0.0)) == pytest.approx(without, rel=1e-5)
    ablated = tg.ablated(TEST, ["prefix_loss"])
    assert TEST.stages[0].prefix_start == 0.25
    assert {tg.plan_step(ablated, s).prefix_weight for s in range(tg.total_steps(ablated))} == {0.0}


def test_bigram_hash_matches_loop_for_torch_and_numpy():
    """Position 0: the reserved row. Position 1: the sentinel B-1 stands in for the previous token and
    27191 * 377279 wraps around in int32 (the record's quirk). Later positions: (prev, cur)."""
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 50257, size=200)
    B = 377_280

    def int32(x):  # two's-complement wrap, as the record's int32 tensors do
        x &= 0xFFFFFFFF
        return x - 2**32 if x >= 2**31 else x

    prevs = [B - 1] + [int(p) for p in toks[1:-1]]
    ref = [B - 1] + [int32(int32(36313 * int(c)) ^ int32(27191 * p)) % (B - 1) for p, c in zip(prevs, toks[1:])]
    assert 27191 * (B - 1) >= 2**31  # the wrap really happens at position 1
    assert ref[1] != ((36313 * int(toks[1])) ^ (27191 * int(toks[0]))) % (B - 1)
    assert all(0 <= h < B - 1 for h in ref[1:])
    assert tg.bigram_hash(toks, B).tolist() == ref
    assert tg.bigram_hash(torch.from_numpy(toks.astype(np.uint16).astype(np.int32)), B).tolist() == ref


# ---- shapes, presets, config errors --------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4, 8, 16])
def test_speedrun_parameter_shapes_on_meta(world_size):
    """The record's table of parameters (its section 1.2; records/README.md, fidelity table), about 643.75M elements at 8 ranks."""
    shapes = tg.count_parameters(tg.Hyperparameters(), world_size)
    counts = {k: math.prod(v) for k, v in shapes.items()}
    print(f"world_size={world_size}: " + ", ".join(f"{k}={v:,}" for k, v in counts.items()),
          f"total={sum(counts.values()):,}")
    pad = lambda n: -(-n // world_size) * world_size  # noqa: E731
    assert shapes["qk_bank"] == (pad(60), 256, 768)   # (layer, Q or K, head pair) of 10 attention layers
    assert shapes["vo_bank"] == (pad(20), 768, 768)
    assert shapes["mlp_bank"] == (pad(22), 3072, 768)
    if world_size == 8:  # the record's padded banks: 64, 24 and 24 (12 x 2) matrices
        assert (shapes["qk_bank"][0], shapes["vo_bank"][0], shapes["mlp_bank"][0]) == (64, 24, 24)
    assert shapes["embed"] == (50304, 768) and shapes["lm_head"] == (768, 50304)
    assert shapes["value_embeds"] == (5, 50304, 768)
    assert shapes["bigram_embed"] == (377_280, 768)
    assert shapes["scalars"] == (24,)  # 11 x (qkv, o), smear, skip; a multiple of 8
    assert shapes["resid_lambdas"] == shapes["post_lambdas"] == (11, 2)
    assert shapes["ve_gate_bank"] == (5, 6, 12)
    assert shapes["smear_gate"] == (1, 12)
    assert shapes["mudd_w1"] == shapes["mudd_gate_w1"] == (2, 64, 768) and shapes["_mudd_gate_scale"] == ()
    assert shapes["mudd_w2"] == (2, 14, 64) and shapes["mudd_b2"] == (2, 14)
    assert shapes["mudd_gate_w2"] == (2, 41, 64) and shapes["mudd_gate_b2"] == (2, 41)
    if world_size == 8:
        assert abs(sum(counts.values()) - 643.75e6) < 0.01e6
    assert 20 * 768 * 768 * 2 + 22 * 3072 * 768 == 75_497_472  # block matrices without padding
    assert counts["lm_head"] == 38_633_472 and counts["bigram_embed"] == 289_751_040
    assert counts["value_embeds"] == 193_167_360


def test_speedrun_inits_match_the_record():
    """Init statistics of the record's parameter table: uniform bound 1/32 (std 0.01804) for Q, K, V, O and
    MLP-up, lm_head std 0.005, value embeddings 0.01 N(0, 1), lambdas and scalars, zero gates, MLP-down
    and padding."""
    args = dataclasses.replace(tg.Hyperparameters(), padded_vocab_size=8192, vocab_size=8000, ngram_rows=1024)
    model = make_model(args, world_size=8)
    f = lambda t: t.float()  # noqa: E731
    qk = f(model.qk_bank)
    assert qk[:60].abs().max() <= 1 / 32 and qk[:60].std().item() == pytest.approx(1 / 32 / math.sqrt(3), rel=0.01)
    assert (qk[60:] == 0).all()
    vo = f(model.vo_bank)
    # record section 1.2: "first 20: U(-1/32, 1/32); last 4: zeros", V (even) and O (odd) alike. Per matrix
    # of 589,824 draws: mean 0 (std of the mean 2.3e-5), std 1/32/sqrt(3) = 0.018042, inside the bound
    # (bf16 rounding can reach it exactly, never past it) and filling it
    for m in vo[:20]:
        assert abs(m.mean().item()) < 1.5e-4 and m.std().item() == pytest.approx(0.018042, rel=0.01)
        assert m.abs().max() <= 1 / 32 and m.abs().max() > 0.98 / 32
    assert (vo[20:] == 0).all()
    mlp = f(model.mlp_bank)
    assert mlp[0::2].std().item() == pytest.approx(0.018042, rel=0.01)  # every up-projection, padding index 22 too
    assert mlp[22].abs().max() > 0 and (mlp[1::2] == 0).all()
    assert f(model.lm_head).std().item() == pytest.approx(0.005, rel=0.02)
    assert torch.equal(model.embed, model.lm_head.T)
    assert f(model.value_embeds).std().item() == pytest.approx(0.01, rel=0.02)
    assert (model.bigram_embed == 0).all() and (model.ve_gate_bank == 0).all()
    assert (model.smear_gate == 0).all()
    L = 11
    expected = torch.tensor([0.5, 1.0] * L + [0.0, -1.5])  # qkv/o lambdas, smear, skip
    assert torch.equal(model.scalars.data, expected)
    assert torch.equal(model.resid_lambdas.data, torch.full((L, 2), math.sqrt(1.1)))
    assert model.resid_lambdas.bfloat16()[0, 0].item() == 1.046875  # cast to bf16 at use
    assert (model.post_lambdas == 1).all()
    dtypes = {label: p.dtype for label, p in model.params_by_label().items()}
    assert {k for k, v in dtypes.items() if v == torch.float32} == {
        "scalars", "resid_lambdas", "post_lambdas", "_mudd_gate_scale"}


def test_initial_weights_do_not_depend_on_the_world_size_or_the_ownership():
    """One seed, one model on any number of ranks: the record's draws, whatever padding this run's ranks or
    --bank_ownership give a bank. The record's MLP bank is (12, 2, 3072, 768) at any world size (section
    1.2), so it draws 12 up-projections for 11 layers, the padding's too, before lm_head; checked here by
    hand in its order (Q/K, V/O, the 12 up-projections, lm_head) at a small width."""
    args = dataclasses.replace(tg.Hyperparameters(), model_dim=64, num_heads=2, head_dim=32, mlp_hidden=128,
                               padded_vocab_size=512, vocab_size=500, ngram_rows=64)
    n_attn = sum(row.has_attention for row in args.layers)
    assert (len(args.layers), n_attn) == (11, 10)
    torch.manual_seed(0)
    bound = math.sqrt(3) * 0.5 / math.sqrt(64)
    qk = torch.empty(2 * n_attn, 64, 64).uniform_(-bound, bound)  # 2 heads: one Q and one K group a layer
    vo = torch.empty(2 * n_attn, 64, 64).uniform_(-bound, bound)
    up = torch.empty(12, 128, 64).uniform_(-bound, bound)
    lm_head = torch.empty(64, 512).normal_(0.0, 0.005)
    bf16 = torch.bfloat16
    record = None
    for world_size, ownership in ((8, "padded"), (1, "padded"), (2, "padded"), (3, "padded"), (16, "padded"),
                                  (1, "balanced"), (3, "balanced"), (8, "balanced")):
        model = make_model(dataclasses.replace(args, bank_ownership=ownership), world_size=world_size)
        where = f"{world_size} ranks, {ownership}"
        real = {name: [i for i, role in enumerate(roles) if role != "pad"] for name, roles in model.bank_roles.items()}
        assert torch.equal(model.qk_bank[real["qk_bank"]], qk.to(bf16)), where
        assert torch.equal(model.vo_bank[real["vo_bank"]], vo.to(bf16)), where
        assert torch.equal(model.mlp_bank[0:22:2], up[:11].to(bf16)), where
        assert torch.equal(model.lm_head, lm_head.to(bf16)), where
        pads = model.mlp_bank[22::2]  # the record's padding up-projection where the bank has it, zeros after it
        assert all(torch.equal(m, up[11].to(bf16) if i == 0 else torch.zeros_like(m)) for i, m in enumerate(pads)), where
        params = {name: (p[real[name]] if name in real else p) for name, p in model.named_parameters()}
        record = record or params  # the record's 8 GPUs first: every other parameter as drawn there
        assert all(torch.equal(p, record[name]) for name, p in params.items()), where


def test_bank_roles_cover_every_matrix_once():
    model = make_model(world_size=8)
    roles = model.bank_roles
    assert roles["mlp_bank"][:4] == ["up.0", "down.0", "up.1", "down.1"]
    assert roles["qk_bank"][:2] == ["q.0.0", "k.0.0"]  # test preset: 2 heads, one pair per Q and K
    assert not any(r.startswith("q.2.") for r in roles["qk_bank"]) and "q.3.0" in roles["qk_bank"]  # layer 2: no attention
    for name, r in roles.items():
        assert len(r) == getattr(model, name).shape[0] and len(r) % 8 == 0
        real = [x for x in r if x != "pad"]
        assert len(real) == len(set(real))


def test_labels_are_unique_and_complete():
    model = make_model()
    labels = model.params_by_label()
    assert len(labels) == len(list(model.parameters()))
    assert set(labels) == set(tg.SCATTER_ORDER) - {"mudd_w2g"} == set(tg.WORK_ORDER) - {"mudd_w2g"}
    assert set(labels) == {"qk_bank", "vo_bank", "mlp_bank", "scalars", "smear_gate", "ve_gate_bank", "lm_head",
                           "bigram_embed", "post_lambdas", "resid_lambdas", "value_embeds", "embed",
                           "mudd_w1", "mudd_w2", "mudd_b2", "mudd_gate_w1", "mudd_gate_w2", "mudd_gate_b2",
                           "_mudd_gate_scale"}
    assert torch.equal(model.embed, model.lm_head.T)  # tied at init


def test_demo_preset_forward_backward():
    args = tg.parse_args(["--preset", "demo"])
    model = make_model(args)
    inputs, targets, cu = make_batch(T=128)
    loss, _ = model(inputs, targets, cu, bigrams(inputs, args), mtp_weights=torch.tensor([1.0, 0.5]), loss_scale=1 / 128)
    loss.backward()
    assert torch.isfinite(loss) and model.mlp_bank.grad.abs().sum() > 0


@pytest.mark.slow
def test_speedrun_preset_forward_backward_on_cpu():
    """The record's model at its real size in bf16, one forward and backward: the loss of 32 tokens at
    initialization near ln(50304). 32 tokens, not more: bf16 products are slow on a CPU without bf16 units
    (19 s at 128 tokens on AVX2, 7 s at 32)."""
    model = make_model(tg.Hyperparameters(), world_size=8)
    inputs, targets, cu = make_batch(T=32, starts=(0, 10, 20))
    loss, _ = model(inputs, targets, cu, bigrams(inputs, model.args), mtp_weights=torch.tensor([1.0]), loss_scale=1 / 32)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(50304), abs=0.05)
    assert model.lm_head.grad.abs().sum() > 0


@pytest.mark.parametrize("override, message", [
    (dict(model_dim=96), "--model_dim"),
    (dict(num_heads=1, head_dim=64), "--num_heads must be even"),
    (dict(layers=tg.layers_from_words(("paired short save_skip", "skip save_h ve", "attn long post_gates", "attn long ve from_h mudd"))),
     "--layers row 1 \\(skip ve save_h\\): a skip or no_attn row has no attention"),
    (dict(layers=tg.layers_from_words(("paired short xsa", "attn long ve save_skip save_h post_gates", "attn long from_h mudd"))),
     "paired rows take no offset, xsa or dc"),
    (dict(layers=tg.layers_from_words(("attn short ve save_skip save_h", "attn long from_h mudd post_gates", "attn short"))),
     "the mudd row must be the last layer"),
    (dict(layers=tg.layers_from_words(("attn short ve save_skip", "attn long from_h mudd post_gates"))), "exactly one row must be save_h"),
    (dict(head_dim=30, num_heads=2, model_dim=60), "--head_dim"),
    (dict(windows_init=(1,)), "--windows_init"),
    (dict(padded_vocab_size=100), "--padded_vocab_size"),
])
def test_bad_config_gives_one_line_error(override, message):
    with pytest.raises(ValueError, match=message) as e:
        tg.GPT(dataclasses.replace(TEST, **override))
    assert "\n" not in str(e.value)


def test_model_fields_parse_from_command_line():
    args = tg.parse_args(["--preset", "test", "--ablate", "paired_heads", "--fp8", "false", "--windows_init", "(2, 4)"])
    assert args.fp8 is False and args.windows_init == (2, 4)
    assert [row.attention for row in args.layers] == ["plain", "plain", "none", "plain"]  # the preset's row 0 was paired
    model = tg.GPT(args)
    assert model.windows.tolist() == [2 * 16, 4 * 16]


# ---- torch.compile -------------------------------------------------------------------------------


def test_emulated_cpu_capability_gets_its_own_inductor_cache():
    """conftest keeps runs under ATEN_CPU_CAPABILITY (e.g. the AVX2 emulation) out of the shared cache."""
    from conftest import inductor_cache_dir

    assert inductor_cache_dir({}) is None
    assert inductor_cache_dir({"TORCHINDUCTOR_CACHE_DIR": "/c"}) is None
    assert inductor_cache_dir({"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": "/c"}) == "/c_isa_avx2"
    assert inductor_cache_dir({"ATEN_CPU_CAPABILITY": "AVX2", "TORCHINDUCTOR_CACHE_DIR": "/c_isa_avx2"}) == "/c_isa_avx2"
    default = inductor_cache_dir({"ATEN_CPU_CAPABILITY": "avx512"})
    assert default.endswith("_isa_avx512") and os.path.basename(default).startswith("torchinductor")
    if os.environ.get("ATEN_CPU_CAPABILITY"):  # this very run
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith("_isa_" + os.environ["ATEN_CPU_CAPABILITY"].lower())


@pytest.mark.slow
def test_compiled_forward_backward_matches_eager_on_cpu():
    """fp32 weights (the CPU fp32 mode): inductor's code and eager agree far below the effect of a window
    change, and the change reaches the one compiled graph through its mask inputs (built outside the
    graph, as forward_backward builds them), not by compiling again. Three rows hold every layer kind and
    option of the test table (paired, skip, and one attention row with all the rest). The YaRN state stays
    at 8 blocks: its softmax scale is a number in the graph (the record's FA3 call takes a float), so a
    YaRN step compiles a graph of its own, as every stage does in the warm-up."""
    from torch._inductor.compile_fx import compile_fx
    torch.manual_seed(0)
    args = dataclasses.replace(TEST, layers=tg.layers_from_words(
        ("paired short save_skip save_h", "skip", "attn long offset ve xsa gate dc from_h mudd post_gates")))
    assert {w for row in args.layers for w in tg.layer_words(row).split()} \
        >= {w for row in TEST.layers for w in tg.layer_words(row).split()}
    model = tg.GPT(args, dtype=torch.float32)
    randomize(model, seed=6)
    inputs, targets, cu = make_batch(starts=(0, 100))  # a document of 100 tokens: windows of 64 and 128 differ
    big = bigrams(inputs)
    w = torch.tensor([1.0, 0.5, 0.25])
    model.prefix_table.copy_(tg.build_prefix_table(tg.gpt2_encoding(), args.padded_vocab_size))
    compiles = []

    def inductor(gm, example_inputs):
        compiles.append(len(example_inputs))
        return compile_fx(gm, example_inputs)

    compiled = torch.compile(model, backend=inductor, dynamic=False, fullgraph=True)  # no graph breaks anywhere

    def run(m):
        model.zero_grad(set_to_none=True)
        loss, _ = m(inputs, targets, cu, big, mtp_weights=w, loss_scale=1 / 128, prefix_weight=torch.tensor(0.25),
                    masks=model.attention_masks(cu, inputs.numel()))
        loss.backward()
        return loss.detach(), model.qk_bank.grad.clone(), model.lm_head.grad.clone()

    losses = []
    for windows in ((4, 4), (8, 8)):
        model.set_windows(*windows, yarn_blocks=8)
        eager, comp = run(model), run(compiled)
        losses.append((eager[0].item(), comp[0].item()))
        for a, b in zip(eager[1:], comp[1:]):
            assert (a.float() - b.float()).norm() / a.float().norm() < 1e-4
    assert len(compiles) == 1, compiles
    change = abs(losses[1][0] - losses[0][0])
    assert change > 1e-3, losses
    for e, c in losses:
        assert abs(e - c) < change / 100, losses


def test_rms_norm_eps_is_fp32_machine_epsilon():
    """The record's F.rms_norm(x, eps=None) on bf16 uses fp32 epsilon (1.19e-7), not 1e-6: visible on
    tiny inputs, where the eps term dominates."""
    x = torch.full((1, 8), 1e-4)
    expected = 1e-4 / math.sqrt(1e-8 + 2.0 ** -23)
    assert tg.norm(x)[0, 0].item() == pytest.approx(expected, rel=1e-5)
    assert abs(expected - 1e-4 / math.sqrt(1e-8 + 1e-6)) > 0.1  # eps 1e-6 gives 0.0995, not 0.278


def test_set_windows_never_makes_the_host_wait():
    """GPT.set_windows runs when a stage starts, between steps whose kernels are still queued: the GPU
    check on an H200 (records/gpu_check, sync-free-step) caught its blocking host-to-device copies. Every
    copy it makes must be non_blocking (train_gpt.copy_from_host_ pins the source on CUDA), and nothing
    may read a value back to the host."""
    from torch.utils._python_dispatch import TorchDispatchMode
    aten = torch.ops.aten

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            self.calls.append((func, args, kwargs))
            return func(*args, **kwargs)

    model = make_model()
    with Record() as rec:
        model.set_windows(2, 5)
    copies = [(a, k) for f, a, k in rec.calls if f is aten.copy_.default]
    assert len(copies) >= 2  # the windows and the rotary frequencies
    blocking = [a[0].shape for a, k in copies if not k.get("non_blocking", a[2] if len(a) > 2 else False)]
    assert not blocking, f"blocking copies into buffers of shape {blocking}"
    reads = {f for f, _, _ in rec.calls} & {aten._local_scalar_dense.default, aten.item.default, aten.nonzero.default}
    assert not reads
    assert model.windows.tolist() == [2 * TEST.window_block_size, 5 * TEST.window_block_size]


def test_rows_without_x0_or_ngram_drop_exactly_those_terms():
    """Layer.x0 and Layer.ngram (record #92 injects x0 and the n-gram features on some rows only): a model whose
    row 0 has no_ngram and row 1 no_x0 computes, to the bit, the default rows' model with those two gated terms'
    coefficients zeroed (the gate layout loses their entries; the other weights are the same), in float64."""
    rows = list(TEST.layers)
    rows[0], rows[1] = dataclasses.replace(rows[0], ngram=False), dataclasses.replace(rows[1], x0=False)
    assert tg.layer_words(rows[0]).endswith("no_ngram") and tg.layers_from_words([tg.layer_words(rows[1])])[0] == rows[1]
    args = dataclasses.replace(TEST, layers=tuple(rows))
    full, cut = tg.GPT(TEST, dtype=torch.float64), tg.GPT(args, dtype=torch.float64)
    randomize(full)
    with torch.no_grad():
        for name, p in (*cut.named_parameters(), *cut.named_buffers()):
            if not name.startswith("mudd_gate_"):
                p.copy_(full.get_parameter(name) if "." not in name and name in dict(full.named_parameters())
                        else full.get_buffer(name))
        for k, layout in enumerate(cut.gate_layout):  # every entry the cut model keeps, from the full model's
            for key, (start, width) in layout.items():
                src, _ = full.gate_layout[k][key]
                cut.mudd_gate_w2[k, start:start + width] = full.mudd_gate_w2[k, src:src + width]
                cut.mudd_gate_b2[k, start:start + width] = full.mudd_gate_b2[k, src:src + width]
        cut.mudd_gate_w1.copy_(full.mudd_gate_w1)
        cut._mudd_gate_scale.copy_(full._mudd_gate_scale)
    assert set(full.gate_layout[0]) - set(cut.gate_layout[0]) == {("bigram", 0)}
    assert set(full.gate_layout[1]) - set(cut.gate_layout[1]) == {("x0", 1)}
    inputs, targets, cu = make_batch()

    def loss(model):
        return model(inputs, targets, cu, bigrams(inputs), mtp_weights=torch.tensor([1.0]), loss_scale=1 / 128)[0]

    losses = [loss(full)]
    for k, key in ((0, ("bigram", 0)), (1, ("x0", 1))):  # each term zeroed in turn: each moves the loss
        start, width = full.gate_layout[k][key]
        with torch.no_grad():
            full.mudd_gate_w2[k, start:start + width] = 0
            full.mudd_gate_b2[k, start:start + width] = 0
        losses.append(loss(full))
    assert all(abs(a - b) > 1e-5 for a, b in zip(losses, losses[1:])), losses
    # the gate matmuls have other row counts (other blockings): equal to float64 rounding
    assert abs(loss(cut) - losses[-1]) < 1e-12
    with pytest.raises(ValueError, match="no_x0 and no_ngram are for attention and no_attn rows"):
        tg.check_layers(tuple(dataclasses.replace(r, x0=False) if r.mudd else r for r in TEST.layers))


def test_no_attn_and_no_mlp_rows_are_the_residual_bookkeeping_alone():
    """Record #92's attention-less and removed layers as rows: a model whose row 0 is no_attn and row 1 no_mlp
    computes, to float64 rounding, the default rows' model with those sublayers' post lambdas at 0 (so the
    sublayer adds 0: x = resid_lambda x and the row's injections); the no_mlp row's bank slots get no gradient
    and lr multiplier 0, the no_attn row no attention matrices."""
    rows = list(TEST.layers)
    rows[0] = tg.layers_from_words(["no_attn save_skip"])[0]
    rows[1] = dataclasses.replace(rows[1], mlp=False)
    assert tg.layer_words(rows[1]).endswith("no_mlp")
    args = dataclasses.replace(TEST, layers=tuple(rows))
    full, cut = tg.GPT(TEST, dtype=torch.float64), tg.GPT(args, dtype=torch.float64)
    randomize(full)
    assert cut.attn_layers == [1, 3] and full.attn_layers == [0, 1, 3]
    with torch.no_grad():
        for name, p in (*cut.named_parameters(), *cut.named_buffers()):
            if name in full.bank_roles:  # the banks by role: the cut model has no layer-0 attention matrices
                src = {role: j for j, role in enumerate(full.bank_roles[name])}
                for j, role in enumerate(cut.bank_roles[name]):
                    if role != "pad":
                        p[j] = getattr(full, name)[src[role]]
            elif "." not in name:
                p.copy_(getattr(full, name))
        full.post_lambdas[0, 0] = 0  # row 0's attention adds nothing
        full.post_lambdas[1, 1] = 0  # row 1's MLP adds nothing
    inputs, targets, cu = make_batch()

    def loss(model):
        return model(inputs, targets, cu, bigrams(inputs), mtp_weights=torch.tensor([1.0]), loss_scale=1 / 128)[0]

    ours = loss(cut)
    assert abs(ours - loss(full)) < 1e-12
    ours.backward()
    assert cut.mlp_bank.grad[2:4].abs().sum() == 0 and cut.mlp_bank.grad[0:2].abs().sum() > 0
    lr = tg.optimizer_configs(args, cut)["mlp_bank"].matrix_lr_mul
    assert lr[:4] == (1.0, 2.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="a skip or no_attn row has no attention"):
        tg.layers_from_words(["no_attn short"]) and tg.check_layers(tg.layers_from_words(["no_attn short"]))


def test_a_parallel_mlp_is_a_wider_mlp_on_that_row():
    """Record #92's parallel MLP (row 1 here, word parallel_mlp): two ReLU^2 MLPs on one input at one post
    lambda equal one MLP with both hidden layers side by side, so the model equals, to float64 rounding, the
    default rows' model at twice the hidden width whose other rows' extra hidden units are zero. Its bank slots
    follow every layer's (roles parallel_up.1, parallel_down.1; the down one at lr x 2), its FP8 scales too."""
    rows = list(TEST.layers)
    rows[1] = dataclasses.replace(rows[1], parallel_mlp=True)
    args = dataclasses.replace(TEST, layers=tuple(rows))
    par = tg.GPT(args, dtype=torch.float64)
    wide = tg.GPT(dataclasses.replace(TEST, mlp_hidden=2 * TEST.mlp_hidden), dtype=torch.float64)
    randomize(par)
    L, Hd = len(rows), TEST.mlp_hidden
    assert par.bank_roles["mlp_bank"][2 * L:] == ["parallel_up.1", "parallel_down.1"]
    assert par.fp8_mlp.up_f8.shape[0] == L + 1
    with torch.no_grad():
        for name, p in (*wide.named_parameters(), *wide.named_buffers()):
            if name == "mlp_bank":
                p.zero_()
                p[:2 * L, :Hd] = par.mlp_bank[:2 * L]
                p[2:4, Hd:] = par.mlp_bank[2 * L:2 * L + 2]  # row 1's second half: the parallel MLP
            elif "." not in name:
                p.copy_(getattr(par, name))
    inputs, targets, cu = make_batch()

    def loss(model):
        return model(inputs, targets, cu, bigrams(inputs), mtp_weights=torch.tensor([1.0]), loss_scale=1 / 128)[0]

    ours = loss(par)
    assert abs(ours - loss(wide)) < 1e-12
    with torch.no_grad():
        par.mlp_bank[2 * L + 1] = 0  # without the parallel MLP's output the loss moves
    assert abs(loss(par) - ours) > 1e-6
    lr = tg.optimizer_configs(args, par)["mlp_bank"].matrix_lr_mul
    assert lr[2 * L: 2 * L + 2] == (1.0, 2.0)


def test_record_92s_post_loop_mix_against_a_float64_loop(monkeypatch):
    """--mudd_post_mix 10: ten sources (MUDD_MIX10_SOURCES), each coefficient MUDD layer 1's per token plus a
    delta per 64-channel group, against a loop over tokens, groups and sources in float64; the forward hands it
    cache0, h, the mudd row's input, the value-embedding tables 0, 1, -1, -2, the skip source, the last MLP's
    input and norm(h); with the five extra coefficients and the deltas zero it is record #89's mix."""
    rows = list(TEST.layers)
    rows[0] = dataclasses.replace(rows[0], value_embed=True)  # three tables: ve.1 and ve.-2 differ
    args = dataclasses.replace(TEST, layers=tuple(rows), model_dim=128, num_heads=4, mudd_post_mix=10)
    model = tg.GPT(args, dtype=torch.float64)
    randomize(model)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        model.mudd_w2g.copy_(torch.randn(model.mudd_w2g.shape, generator=g, dtype=torch.float64))
    assert model.mudd_w2g.shape == (14, 2, TEST.mudd_hidden)
    T, D = 6, 128
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    sources = {name: torch.randn(T, D, generator=g, dtype=torch.float64) for name in tg.MUDD_MIX10_SOURCES}
    got = model.post_loop_grouped(x, sources)
    w1, w2, b2, w2g = (t.detach() for t in (model.mudd_w1[1], model.mudd_w2[1], model.mudd_b2[1], model.mudd_w2g))
    want = x.clone()
    for t in range(T):
        hidden = [0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in (w1 @ x[t]).tolist()]
        hidden = torch.tensor(hidden, dtype=torch.float64)
        for k, name in enumerate(tg.MUDD_MIX10_SOURCES):
            for grp in range(2):
                c = 0.1 * (float(w2[k] @ hidden) + float(b2[k])) + 0.1 * float(w2g[k, grp] @ hidden)
                want[t, 64 * grp:64 * grp + 64] += c * sources[name][t, 64 * grp:64 * grp + 64]
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # the extra five coefficients and the deltas zero: record #89's five-source mix
        model.mudd_w2g.zero_()
        model.mudd_w2[1, 5:10] = 0
        model.mudd_b2[1, 5:10] = 0
    five = model.post_loop(x, *(sources[n] for n in ("cache0", "h", "mudd_input", "ve.0", "skip_source")))
    assert torch.allclose(model.post_loop_grouped(x, sources), five, rtol=1e-12, atol=1e-12)
    # the forward's sources
    seen, mlp_inputs = {}, []
    monkeypatch.setattr(model, "post_loop_grouped", lambda x, s: seen.update(s) or x)
    mlp = tg.MLPS["bf16"]
    monkeypatch.setitem(tg.MLPS, "bf16", lambda state, i, xn, *w: mlp_inputs.append(xn) or mlp(state, i, xn, *w))
    inputs, targets, cu = make_batch()
    model(inputs, targets, cu, bigrams(inputs, args), mtp_weights=torch.tensor([1.0]), loss_scale=1 / 128)
    ve = model.value_embeddings(inputs.view(-1))
    assert len(ve) == 3 and set(seen) == set(tg.MUDD_MIX10_SOURCES)
    assert all(torch.equal(seen[f"ve.{k}"], ve[k]) for k in (0, 1, -1, -2))
    assert torch.equal(seen["mlp_input"], mlp_inputs[-1]) and torch.equal(seen["h_normed"], tg.norm(seen["h"]))


def test_narrow_rows_attend_over_the_first_half_of_each_heads_rows():
    """Record #92's narrow rows (narrow_qk: Q and K half of head_dim, all of it rotating; narrow_v: V and O
    too): layer 0's attention in float64 against a reference written from that description: the first half of
    each head's Q, K and V rows of the banks, rms-normed Q and K rotated as head_dim/4 pairs at the record's
    frequencies, the value embedding's first half per head under its gate, a causal same-document window,
    the first half of each head's O columns. The other half of those rows gets no gradient."""
    rows = list(TEST.layers)
    rows[0] = tg.layers_from_words(["attn short ve narrow_qk narrow_v save_skip"])[0]
    assert tg.layer_words(rows[0]).endswith("narrow_qk narrow_v")
    args = dataclasses.replace(TEST, layers=tuple(rows), head_dim=16, num_heads=4)
    model = tg.GPT(args, dtype=torch.float64)
    randomize(model)
    inputs, _, cu = make_batch(T=48, starts=(0, 20))
    T, H, hd, half = 48, 4, 16, 8
    g = torch.Generator().manual_seed(3)
    xn = tg.norm(torch.randn(T, 64, generator=g, dtype=torch.float64))
    ve = model.value_embeddings(inputs)[model.ve_index[0]]
    w = {"qk": model.qk_bank.unbind(0), "vo": model.vo_bank.unbind(0)}
    rope = {"long": tg.rotary_tables(model.rotary_freq, T, H, torch.float64)}
    doc = tg.document_ids(cu, T)
    got = model._attention(0, xn, ve, None, None, doc, rope, model.attention_masks(cu, T), None, w)
    # the reference
    roles = {role: j for j, role in enumerate(model.bank_roles["qk_bank"])}
    Wq = torch.cat([model.qk_bank[roles[f"q.0.{grp}"]] for grp in range(H // 2)]).view(H, hd, 64)[:, :half]
    Wk = torch.cat([model.qk_bank[roles[f"k.0.{grp}"]] for grp in range(H // 2)]).view(H, hd, 64)[:, :half]
    Wv = model.vo_bank[0].view(H, hd, 64)[:, :half]
    Wo = model.vo_bank[1].view(64, H, hd)[:, :, :half]
    lam_in, lam_out = model.scalars[0], model.scalars[1]
    freq = model.rotary_freq.double()

    def rotate(x):  # (H, half) at position t: pairs (2j, 2j+1) by angle t * freq[j]
        return lambda t: torch.stack([x[:, 0::2] * torch.cos(t * freq) + x[:, 1::2] * torch.sin(t * freq),
                                      x[:, 1::2] * torch.cos(t * freq) - x[:, 0::2] * torch.sin(t * freq)], -1).view(H, half)

    def rms(x):
        return x / x.square().mean(-1, keepdim=True).add(torch.finfo(torch.float32).eps).sqrt()

    C = args.gate_channels // 2
    gate = 2 * torch.sigmoid(torch.cat([xn[:, :C], ve[:, :C]], -1) @ model.ve_gate_bank[model.ve_index[0]].T)
    q = [rotate(rms(torch.einsum("hdc,c->hd", lam_in * Wq, xn[t])))(t) for t in range(T)]
    k = [rotate(rms(torch.einsum("hdc,c->hd", lam_in * Wk, xn[t])))(t) for t in range(T)]
    v = [torch.einsum("hdc,c->hd", lam_in * Wv, xn[t]) + gate[t, :, None] * ve[t].view(H, hd)[:, :half]
         for t in range(T)]
    window = model.window_tokens[0]
    want = torch.zeros(T, 64, dtype=torch.float64)
    for t in range(T):
        keys = [s for s in range(t + 1) if t - s <= window and doc[s] == doc[t]]
        y = torch.zeros(H, half, dtype=torch.float64)
        for h in range(H):
            p = torch.softmax(torch.tensor([model.attn_scale_value * float((q[t][h] @ k[s][h]).detach()) for s in keys]), 0)
            y[h] = sum(p[n] * v[s][h] for n, s in enumerate(keys))
        want[t] = torch.einsum("ehd,hd->e", lam_out * Wo, y)
    assert want.abs().mean() > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)  # the rotary angles are fp32's (rotary_tables)
    got.square().sum().backward()
    dead_q = torch.stack([model.qk_bank.grad[roles[f"q.0.{grp}"]] for grp in range(H // 2)]).view(-1, H // 2 * 2, hd, 64)
    assert dead_q[..., half:, :].abs().sum() == 0 and dead_q[..., :half, :].abs().sum() > 0
    assert model.vo_bank.grad[0].view(H, hd, 64)[:, half:].abs().sum() == 0
    assert model.vo_bank.grad[1].view(64, H, hd)[:, :, half:].abs().sum() == 0


def test_record_92s_yarn_chains_give_its_scales():
    """--yarn_chains own (record #92's): the short-window rows' softmax scale starts at attn_scale_short (0.13)
    and grows with the short window, the long rows' at attn_scale (0.085) with the long window; over #92's
    windows (1, 3) -> (3, 7) -> (5, 11) -> (6, 13) that is #92's published 0.13 -> 0.158564 -> 0.174764 ->
    0.181136 and 0.085 -> 0.099404 -> 0.108390 -> 0.112011; the final validation's (6, 20) with YaRN at 13
    changes neither. Each row attends at its chain's scale with its chain's rotary tables."""
    args = dataclasses.replace(TEST, stages=tg.RECORD92_STAGES, head_dim=128, model_dim=256, yarn_chains="own",
                               attn_scale=0.085, attn_scale_short=0.13, window_block_size=16)
    model = tg.GPT(args, dtype=torch.float32)
    short, long_ = [], []
    for windows in ((1, 3), (3, 7), (5, 11), (6, 13)):
        model.set_windows(*windows)
        short.append(model.attn_scale_short_value)
        long_.append(model.attn_scale_value)
    assert short == pytest.approx([0.13, 0.158564, 0.174764, 0.181136], abs=1e-6)
    assert long_ == pytest.approx([0.085, 0.099404, 0.108390, 0.112011], abs=1e-6)
    model.set_windows(6, 20, yarn_blocks=13)
    assert (model.attn_scale_short_value, model.attn_scale_value) == (short[-1], long_[-1])
    assert not torch.equal(model.rotary_freq, model.rotary_freq_short)  # the chains' YaRN steps differ
    # the rows' scales and tables in a forward: short rows the short chain's, long rows the long one's
    seen, cosines = [], []
    attend, rotate = tg.ATTEND[tg.SDPAMask], tg.apply_rotary
    tg.ATTEND[tg.SDPAMask] = lambda q, k, v, mask, r, scale, value: seen.append(value) or attend(q, k, v, mask, r, scale, value)
    tg.apply_rotary = lambda x, cos, sin: cosines.append(cos) or rotate(x, cos, sin)
    try:
        inputs, targets, cu = make_batch()
        with torch.no_grad():
            model(inputs, targets, cu, bigrams(inputs), mtp_weights=torch.tensor([1.0]), loss_scale=1 / 128)
    finally:
        tg.ATTEND[tg.SDPAMask], tg.apply_rotary = attend, rotate
    rows = [r for r in args.layers if r.has_attention]
    assert seen == [short[-1] if r.window == "short" else long_[-1] for r in rows] and len(set(seen)) == 2
    for r, cos in zip(rows, cosines[::2]):  # q's tables (k's are the same)
        freq = model.rotary_freq_short if r.window == "short" else model.rotary_freq
        want = tg.rotary_tables(freq, 128, args.num_heads, torch.float32)["paired" if r.attention == "paired" else "plain"][0]
        assert torch.equal(cos, want)
    assert model.yarn_chain(rows[0]) == "short" and tg.GPT(TEST).yarn_chain(rows[0]) == "long"
