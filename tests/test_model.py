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

TEST = tg.parse_args(["--preset", "test"])


def make_batch(T=128, starts=(0, 30, 70, 100), pad_to=8, seed=0, vocab=50257):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (T + 1,), generator=g)
    cu = torch.tensor(list(starts) + [T] * (pad_to - len(starts)), dtype=torch.int32)
    return tokens[:-1].clone(), tokens[1:].clone(), cu


def bigrams(inputs, args=TEST):
    return tg.bigram_hash(inputs, args.bigram_vocab_size)


@torch.no_grad()
def randomize(model: tg.GPT, seed=0):
    """Give every parameter generic non-zero values (zero inits would hide paths), padding excluded."""
    g = torch.Generator().manual_seed(seed)
    D = model.args.model_dim

    def rnd(p, std):
        p.copy_((std * torch.randn(p.shape, generator=g)).to(p.dtype))

    for name in ("qk_bank", "vo_bank", "mlp_bank"):
        bank = getattr(model, name)
        rnd(bank, 0.5 / math.sqrt(D))
        for idx, role in enumerate(model.bank_roles[name]):
            if role == "pad":
                bank[idx].zero_()
    rnd(model.lm_head, 0.3)
    rnd(model.embed, 0.05)
    rnd(model.value_embed, 0.5)
    rnd(model.bigram_embed, 0.5)
    model.scalars.copy_(0.3 + 0.7 * torch.rand(model.scalars.shape, generator=g))
    for p in (model.ve_gates, model.smear_gate, model.skip_gate):
        rnd(p, 0.5)


def make_model(args=TEST, world_size=1, seed=0):
    torch.manual_seed(seed)
    return tg.GPT(args, world_size)


# ---- masks -------------------------------------------------------------------------------------


def brute_force_mask(doc_of_token, window, pos_div):
    n = len(doc_of_token) * pos_div
    m = np.zeros((n, n), dtype=bool)
    for qs in range(n):
        for ks in range(n):
            q, k = qs // pos_div, ks // pos_div
            m[qs, ks] = k <= q and q - k < window and doc_of_token[q] == doc_of_token[k]
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


def expand_block_mask(bm, n, bs):
    """Token-level mask the flex kernel would apply: partial blocks run mask_mod, full blocks pass."""
    idx = torch.arange(n)
    mod = bm.mask_mod(0, 0, idx[:, None], idx[None, :])
    out = torch.zeros(n, n, dtype=torch.bool)
    nb = n // bs
    partial = torch.zeros(nb, nb, dtype=torch.bool)
    full = torch.zeros(nb, nb, dtype=torch.bool)
    for i in range(nb):
        for j in bm.kv_indices[0, 0, i, : bm.kv_num_blocks[0, 0, i]].tolist():
            partial[i, j] = True
        for j in bm.full_kv_indices[0, 0, i, : bm.full_kv_num_blocks[0, 0, i]].tolist():
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
    # 15, 47 (2, 18): a block pair's largest (smallest) token distance lands exactly on the window edge
    for window in (2, 3, 15, 16, 18, 40, 47, 1000):
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
        span = window * pos_div
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
    unpaired layers, short and long windows) matches the same model forced onto dense masks."""
    args = dataclasses.replace(TEST, window_block_size=32)
    model = make_model(args)
    randomize(model, seed=11)
    model.set_windows(2, 5)
    T = 1024
    inputs, targets, cu = make_batch(T=T, starts=(0, 100, 450, 900))
    big = bigrams(inputs)
    assert tg.attention_band(2 * T, 2 * 5 * 32) and tg.attention_band(T, 2 * 32)

    def run():
        model.zero_grad(set_to_none=True)
        loss = model(inputs, targets, cu, big, mtp_weights=torch.tensor([1.0, 0.5, 0.25]), loss_scale=1 / T)
        loss.backward()
        return loss.detach(), model.qk_bank.grad.float(), model.vo_bank.grad.float()

    banded = run()
    monkeypatch.setattr(tg, "attention_band", lambda n, span: 0)
    dense = run()
    assert abs(banded[0].item() - dense[0].item()) < 1e-3
    for a, b in zip(banded[1:], dense[1:]):
        assert (a - b).norm() / b.norm() < 2e-2


# ---- attention semantics -------------------------------------------------------------------------


@pytest.mark.parametrize("paired", [False, True])
def test_attend_matches_float64_brute_force(paired):
    """Paired heads: a query of either head of a pair normalises over the keys of both heads."""
    model = make_model()
    T, H, hd = 40, 2, 8
    doc = torch.tensor([0] * 15 + [1] * 25)
    model.windows.copy_(torch.tensor([6, 11], dtype=torch.int32))
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(T, H, hd, generator=g, dtype=torch.float64) for _ in range(3))
    got = model._attend(q, k, v, doc, long=True, paired=paired, masks={})
    want = torch.zeros(T, H, hd, dtype=torch.float64)
    for t in range(T):
        keys = [s for s in range(T) if s <= t and t - s < 11 and doc[s] == doc[t]]
        for h in range(H):
            heads = [0, 1] if paired else [h]
            logits = torch.tensor([float(q[t, h] @ k[s, hk]) for s in keys for hk in heads], dtype=torch.float64)
            p = torch.softmax(logits, 0)
            vals = torch.stack([v[s, hk] for s in keys for hk in heads])
            want[t, h] = p @ vals
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_document_isolation_is_bit_exact():
    model = make_model()
    randomize(model)
    inputs, _, cu = make_batch()
    with torch.no_grad():
        base = model.logits(inputs, cu, bigrams(inputs))
        changed = inputs.clone()
        changed[30:70] = torch.randint(0, 50257, (40,), generator=torch.Generator().manual_seed(5))
        out = model.logits(changed, cu, bigrams(changed))
    others = torch.cat([torch.arange(0, 30), torch.arange(70, 128)])
    assert torch.equal(out[others], base[others])
    assert not torch.allclose(out[30:70], base[30:70])


def test_causality_is_bit_exact():
    model = make_model()
    randomize(model, seed=3)
    inputs, _, cu = make_batch(starts=(0, 90))
    t = 50
    with torch.no_grad():
        base = model.logits(inputs, cu, bigrams(inputs))
        changed = inputs.clone()
        changed[t] = (changed[t] + 1) % 50257
        out = model.logits(changed, cu, bigrams(changed))
    assert torch.equal(out[:t], base[:t])
    assert not torch.allclose(out[t], base[t])
    assert not torch.allclose(out[t + 5], base[t + 5])  # later positions of the document do see it


def test_windows_limit_what_attention_sees():
    """A token further back than every window (and the skip/smear paths) cannot change the output."""
    model = make_model()
    randomize(model, seed=4)
    inputs, _, cu = make_batch(starts=(0,))
    model.set_windows(1, 2)  # 16 and 32 tokens; 4 layers reach at most 4 * 31 tokens back ...
    with torch.no_grad():
        base = model.logits(inputs, cu, bigrams(inputs))
        changed = inputs.clone()
        changed[0] = (changed[0] + 7) % 50257
        out = model.logits(changed, cu, bigrams(changed))
    # ... attention layers are 0, 1, 3; long windows on 1 and 3: reach 15 + 31 + 31 tokens (+1 smear/bigram)
    assert torch.equal(out[80:], base[80:])
    assert not torch.allclose(out[:40], base[:40])


# ---- YaRN ----------------------------------------------------------------------------------------


def test_yarn_frequencies_and_scale():
    args = dataclasses.replace(TEST, window_block_size=128, windows_init=(1, 3))
    model = make_model(args)
    base = tg.rotary_base_frequencies(args.head_dim).double()
    assert torch.equal(model.rotary_freq.double(), base)
    ref, new = 3 * 128, 11 * 128
    model.set_windows(5, 11)
    s = new / ref
    rotations = ref * base / (2 * math.pi)
    ramp = ((rotations - 1) / 31).clamp(0, 1)
    expected = base * (ramp + (1 - ramp) / s)
    freq = model.rotary_freq.double()
    torch.testing.assert_close(freq, expected, rtol=1e-6, atol=0)
    above, below = rotations >= 32, (rotations <= 1) & (base > 0)
    assert above.any() and below.any() and (~above & ~below & (base > 0)).any()
    assert torch.equal(freq[above], base[above])               # high frequencies untouched
    torch.testing.assert_close(freq[below], base[below] / s)   # low ones interpolated
    assert torch.equal(freq[base == 0], base[base == 0])       # the unrotated half stays unrotated
    expected_scale = 0.12 * math.sqrt(128 / args.head_dim) * (1 + 0.1 * math.log(s)) ** 2
    assert model.attn_scale.item() == pytest.approx(expected_scale, rel=1e-6)
    assert model.windows.tolist() == [5 * 128, 11 * 128]
    model.set_windows(1, 3)  # back to the start (warm-up restore): exactly the base state
    assert torch.equal(model.rotary_freq.double(), base)
    assert model.attn_scale.item() == pytest.approx(0.12 * math.sqrt(128 / args.head_dim), rel=1e-7)


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
    loss = model(inputs, targets, cu, bigrams(inputs), mtp_weights=w, loss_scale=1.0 / T)
    loss.backward()
    assert torch.isfinite(loss)
    # near-zero logits: every term is about ln(V); the last positions lack their t+2 / t+3 terms
    expected = math.log(V) * (T + 0.5 * (T - 1) + 0.25 * (T - 2)) / T
    assert loss.item() == pytest.approx(expected, abs=0.02)
    with torch.no_grad():
        assert model(inputs, targets, cu, bigrams(inputs)).item() == pytest.approx(math.log(V), abs=0.01)
    # exactly-zero gradients at init come only from the documented zero inits
    grads = {label: p.grad for label, p in model.params_by_label().items()}
    zero_at_init = {"qk_bank", "value_embed", "ve_gates", "smear_gate"}
    for label, g in grads.items():
        assert g is not None, label
        assert (g.abs().sum() == 0) == (label in zero_at_init), label
    roles = model.bank_roles
    for idx, role in enumerate(roles["vo_bank"]):
        assert (grads["vo_bank"][idx].abs().sum() > 0) == role.startswith("o."), role
    for idx, role in enumerate(roles["mlp_bank"]):
        assert (grads["mlp_bank"][idx].abs().sum() > 0) == role.startswith("down."), role


def test_every_parameter_gets_a_gradient():
    model = make_model(world_size=4)  # padding: qk/vo 6 -> 8, mlp 8 -> 8
    assert model.bank_roles["qk_bank"][-2:] == ["pad", "pad"]
    randomize(model)
    inputs, targets, cu = make_batch()
    model(inputs, targets, cu, bigrams(inputs), mtp_weights=torch.tensor([1.0, 0.5]), loss_scale=0.01).backward()
    for label, p in model.params_by_label().items():
        assert p.grad is not None and p.grad.dtype == p.dtype, label
        if label in model.bank_roles:
            for idx, role in enumerate(model.bank_roles[label]):
                nz = p.grad[idx].abs().sum() > 0
                assert nz == (role != "pad"), (label, role)
        elif label == "scalars":
            assert (p.grad != 0).all(), p.grad
        elif label in ("value_embed", "ve_gates"):
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
        z = model.logits(inputs, cu, bigrams(inputs)).double()
    assert z.dtype == torch.float64 and z.shape == (128, TEST.padded_vocab_size)
    ref = (torch.logsumexp(z, 1) - z[torch.arange(128), targets]).mean()
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert loss.item() > math.log(TEST.padded_vocab_size) + 0.1  # randomised weights: not the trivial value


def test_training_loss_is_scaled_sum_of_mtp_cross_entropies():
    model = make_model()
    randomize(model, seed=5)
    inputs, targets, cu = make_batch(seed=2)
    T = 128
    with torch.no_grad():
        loss = model(inputs, targets, cu, bigrams(inputs), mtp_weights=torch.tensor([1.0, 0.5, 0.25]), loss_scale=0.125)
        z = model.logits(inputs, cu, bigrams(inputs)).double()
    lse = torch.logsumexp(z, 1)
    ref = 0.0
    for k, wk in enumerate([1.0, 0.5, 0.25]):
        n = T - k
        ref += wk * (lse[:n] - z[torch.arange(n), targets[k:]]).sum()
    assert loss.item() == pytest.approx(0.125 * ref.item(), rel=1e-5)


def test_bigram_hash_matches_loop_for_torch_and_numpy():
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 50257, size=200)
    B = 377_280
    ref = [B - 1] + [((36313 * int(c)) ^ (27191 * int(p))) % (B - 1) for p, c in zip(toks[:-1], toks[1:])]
    assert tg.bigram_hash(toks, B).tolist() == ref
    assert tg.bigram_hash(torch.from_numpy(toks.astype(np.uint16).astype(np.int32)), B).tolist() == ref
    assert ref.count(B - 1) == 1  # the 'no previous token' row is used only at position 0


# ---- shapes, presets, config errors --------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4, 8, 16])
def test_speedrun_parameter_shapes_on_meta(world_size):
    shapes = tg.count_parameters(tg.Hyperparameters(), world_size)
    counts = {k: math.prod(v) for k, v in shapes.items()}
    print(f"world_size={world_size}: " + ", ".join(f"{k}={v:,}" for k, v in counts.items()),
          f"total={sum(counts.values()):,}")
    pad = lambda n: -(-n // world_size) * world_size  # noqa: E731
    assert shapes["qk_bank"] == (pad(20), 768, 768)   # Q, K of 10 attention layers (layer 6 has none)
    assert shapes["vo_bank"] == (pad(20), 768, 768)
    assert shapes["mlp_bank"] == (pad(22), 3072, 768)
    assert shapes["embed"] == (50304, 768) and shapes["lm_head"] == (768, 50304)
    assert shapes["value_embed"] == (5, 50304, 768)
    assert shapes["bigram_embed"] == (377_280, 768)
    assert shapes["scalars"] == (4 * 11 + 2,)
    assert shapes["ve_gates"] == (5, 6, 12)
    assert shapes["smear_gate"] == (1, 12) and shapes["skip_gate"] == (1, 12)
    # SPEC figures: ~75M block-matrix parameters (without padding), ~39M LM head
    assert 20 * 768 * 768 * 2 + 22 * 3072 * 768 == 75_497_472
    assert counts["lm_head"] == 38_633_472


def test_bank_roles_cover_every_matrix_once():
    model = make_model(world_size=8)
    roles = model.bank_roles
    assert roles["mlp_bank"][:4] == ["up.0", "down.0", "up.1", "down.1"]
    assert "q.2" not in roles["qk_bank"] and "q.3" in roles["qk_bank"]  # layer 2: no attention (test preset)
    for name, r in roles.items():
        assert len(r) == getattr(model, name).shape[0] and len(r) % 8 == 0
        real = [x for x in r if x != "pad"]
        assert len(real) == len(set(real))


def test_labels_are_unique_and_complete():
    model = make_model()
    labels = model.params_by_label()
    assert len(labels) == len(list(model.parameters()))
    assert set(labels) == {"qk_bank", "vo_bank", "mlp_bank", "embed", "lm_head", "value_embed",
                           "bigram_embed", "scalars", "ve_gates", "smear_gate", "skip_gate"}
    for label, p in labels.items():
        assert p.dtype == (torch.float32 if label in ("scalars", "ve_gates", "smear_gate", "skip_gate") else torch.bfloat16)
    assert torch.equal(model.embed, model.lm_head.T)  # tied at init


def test_demo_preset_forward_backward():
    args = tg.parse_args(["--preset", "demo"])
    model = make_model(args)
    inputs, targets, cu = make_batch(T=128)
    loss = model(inputs, targets, cu, bigrams(inputs, args), mtp_weights=torch.tensor([1.0, 0.5]), loss_scale=1 / 128)
    loss.backward()
    assert torch.isfinite(loss) and model.mlp_bank.grad.abs().sum() > 0


@pytest.mark.slow
def test_speedrun_preset_forward_backward_on_cpu():
    model = make_model(tg.Hyperparameters(), world_size=8)
    inputs, targets, cu = make_batch(T=128)
    loss = model(inputs, targets, cu, bigrams(inputs, model.args), mtp_weights=torch.tensor([1.0]), loss_scale=1 / 128)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(50304), abs=0.02)
    assert model.lm_head.grad.abs().sum() > 0


@pytest.mark.parametrize("override, message", [
    (dict(model_dim=96), "--model_dim"),
    (dict(num_heads=1, head_dim=64), "--paired_head_layers needs an even --num_heads"),
    (dict(value_embed_layers=(1, 2)), "--value_embed_layers names layers \\[2\\]"),
    (dict(long_window_layers=(7,)), "--long_window_layers"),
    (dict(skip_from_layer=2, skip_to_layer=1), "--skip_from_layer"),
    (dict(head_dim=30, num_heads=2, model_dim=60), "--head_dim"),
    (dict(windows_init=(1,)), "--windows_init"),
    (dict(padded_vocab_size=100), "--padded_vocab_size"),
])
def test_bad_config_gives_one_line_error(override, message):
    with pytest.raises(ValueError, match=message) as e:
        tg.GPT(dataclasses.replace(TEST, **override))
    assert "\n" not in str(e.value)


def test_model_fields_parse_from_command_line():
    args = tg.parse_args(["--preset", "test", "--paired_head_layers", "()", "--fp8", "false", "--windows_init", "(2, 4)"])
    assert args.paired_head_layers == () and args.fp8 is False and args.windows_init == (2, 4)
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
    model = make_model()
    randomize(model, seed=6)
    inputs, targets, cu = make_batch()
    big = bigrams(inputs)
    w = torch.tensor([1.0, 0.5, 0.25])
    compiled = torch.compile(model, dynamic=False, fullgraph=True)  # no graph breaks anywhere

    def run(m):
        model.zero_grad(set_to_none=True)
        loss = m(inputs, targets, cu, big, mtp_weights=w, loss_scale=1 / 128)
        loss.backward()
        return loss.detach(), model.qk_bank.grad.clone(), model.lm_head.grad.clone()

    losses = []
    for windows in ((1, 3), (2, 5)):  # a window change must reach the compiled graph (buffers, not constants)
        model.set_windows(*windows)
        eager, comp = run(model), run(compiled)
        losses.append((eager[0].item(), comp[0].item()))
        for a, b in zip(eager[1:], comp[1:]):
            assert (a.float() - b.float()).norm() / a.float().norm() < 5e-2
    change = abs(losses[1][0] - losses[0][0])
    assert change > 1e-3
    for e, c in losses:
        assert abs(e - c) < change / 4, losses
