"""Record #89's attention sublayer against references written from the fact sheet alone.

Checked:
- the qk_bank / vo_bank index maps (which bank matrix is which layer's Q, K, V or O, and how the heads of
  a Q or K group are laid out), and the padding of the record's 8-GPU banks;
- one attention layer (GPT._attention) at a time against a float64 loop over heads and keys: the weights
  taken from the banks by the record's index arithmetic, QK RMS-norm, RoPE on dims 0-63, paired-head
  positions and slots, key offset, value embeddings and MUDD's V, windows and documents, DC, XSA, the
  output gate and the output projection;
- the RoPE tables and apply_rotary against the rotation formula, up to the record's largest position.

The references use only facts of record #89's published code (its fact sheet's section numbers below) and the
model's raw parameters and window state (qk_bank, vo_bank, ve_gate_bank, scalars, rotary_freq,
attn_scale); they never call the model's helpers (rotary tables, apply_rotary, key_offset, masks,
_attend, xsa, dc_term, bank_roles).
"""

import pytest
import torch

import train_gpt as tg
from test_model import make_batch, randomize
from test_record_model import RECORD_SMALL

H, HD, D = 6, 128, 768
ROT = 64                                         # dims 0-63 rotate, 64-127 do not (section 1.15)
EPS = torch.finfo(torch.float32).eps             # QK RMS-norm eps (section 1.15)
ATTN_LAYERS = [0, 1, 2, 3, 4, 5, 7, 8, 9, 10]    # layer 6 has no attention (section 1.1)

# The attention columns of the per-layer table (section 1.4): paired heads, long window, key offset,
# value-embedding table (the VE gate is ve_gate_bank[that index]; "mudd": gate and V from the MUDD
# layer), XSA, linear output gate, DC.
LAYER_TABLE = {
    0: dict(paired=True),
    1: dict(ve=0, xsa=True),
    2: dict(paired=True, ve=1),
    3: dict(long=True, offset=True, xsa=True, gate=True),
    4: dict(xsa=True),
    5: dict(paired=True),
    7: dict(xsa=True),
    8: dict(ve=2),
    9: dict(paired=True, ve=3),
    10: dict(long=True, offset=True, ve="mudd", gate=True, dc=True),
}
DC_WINDOW = 112  # DC's own token window, whatever the layer's window (section 1.10)


def has(i, what):
    return bool(LAYER_TABLE[i].get(what, False))


# -- the record's index maps (section 1.3) ---------------------------------------------------------

def attn_index(i):
    """Attention-layer index j: layers 0-5 -> 0-5, 7-10 -> 6-9."""
    return i - (i > 6)


def qk_weight(model, i, kind, h):
    """Head h's 128 rows of Q or K of layer i: group g = 6j + c, c = h // 2 for Q and 3 + h // 2 for K;
    the group's first 128 rows are head 2c's, the next 128 head 2c+1's."""
    c = h // 2 + (3 if kind == "k" else 0)
    rows = slice(HD * (h % 2), HD * (h % 2) + HD)
    return model.qk_bank[6 * attn_index(i) + c, rows].double()


def vo_weight(model, i, kind):
    """vo_bank[2j] is V, vo_bank[2j+1] is O (both out = x W^T)."""
    return model.vo_bank[2 * attn_index(i) + (kind == "o")].double()


def projections(model, i, xn):
    """q, k, v (T, 6, 128) = xn (lambda_qkv W)^T with lambda_qkv = scalars[2i] (sections 1.2, 1.6)."""
    lam = model.scalars[2 * i].double()
    q = torch.stack([xn @ (lam * qk_weight(model, i, "q", h)).T for h in range(H)], dim=1)
    k = torch.stack([xn @ (lam * qk_weight(model, i, "k", h)).T for h in range(H)], dim=1)
    v = (xn @ (lam * vo_weight(model, i, "v")).T).view(-1, H, HD)
    return q, k, v


def output_projection(model, i, y):
    """(T, 6, 128) -> (T, 768) = y (lambda_o O)^T with lambda_o = scalars[2i+1]."""
    return y.reshape(y.shape[0], D) @ (model.scalars[2 * i + 1].double() * vo_weight(model, i, "o")).T


# -- float64 building blocks ------------------------------------------------------------------------

def rms_norm(x, eps=EPS):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def rotate(x, pos, freq):
    """Section 1.15: pairs (2j, 2j+1) of dims 0-63 by angle pos * freq[j]:
    out[2j] = cos x[2j] + sin x[2j+1], out[2j+1] = cos x[2j+1] - sin x[2j]; dims 64-127 unchanged.
    x (..., 128), pos broadcastable to x[..., 0]."""
    out = x.clone()
    for j in range(ROT // 2):
        a = pos.double() * float(freq[j])
        c, s = torch.cos(a), torch.sin(a)
        out[..., 2 * j] = c * x[..., 2 * j] + s * x[..., 2 * j + 1]
        out[..., 2 * j + 1] = c * x[..., 2 * j + 1] - s * x[..., 2 * j]
    return out


def rotary_positions(T, paired):
    """(T, 6) rotary position of every token and head: the packed index t (not reset per document),
    or for paired layers 2t for heads 0, 2, 4 and 2t+1 for heads 1, 3, 5 (sections 1.7, 1.15)."""
    t = torch.arange(T)[:, None].expand(T, H)
    return 2 * t + torch.arange(H) % 2 if paired else t


def slot(t, h, paired):
    """Section 1.7: paired layers put heads 0-2 of token t in slot 2t, heads 3-5 in slot 2t+1."""
    return 2 * t + (h >= H // 2) if paired else t


def stream(h, paired):
    """The sequence head h attends within: its own, or for paired layers the pair (0,3), (1,4), (2,5)."""
    return h % (H // 2) if paired else h


def key_offset_ref(k):
    """Section 1.6: k[t, :, 64:] <- (old) k[t-1, :, 64:] for t >= 1, across documents."""
    out = k.clone()
    out[1:, :, ROT:] = k[:-1, :, ROT:]
    return out


def loop_attention(q, k, v, doc, window, paired, scale):
    """For every query (token t, head h), softmax(scale q.k) over the keys (t2, h2) of its stream in the
    same document whose slot is at most `window` slots before its own (section 1.6 step 5, 1.7)."""
    T, doc = q.shape[0], doc.tolist()
    y = torch.zeros_like(v)
    for t in range(T):
        for h in range(H):
            sq, same_stream = slot(t, h, paired), [h2 for h2 in range(H) if stream(h2, paired) == stream(h, paired)]
            keys = [(t2, h2) for t2 in range(max(0, t - window), t + 1) for h2 in same_stream
                    if doc[t2] == doc[t] and 0 <= sq - slot(t2, h2, paired) <= window]
            kt, kh = (torch.tensor(c) for c in zip(*keys))
            p = torch.softmax(scale * (k[kt, kh] @ q[t, h]), dim=0)
            y[t, h] = p @ v[kt, kh]
    return y


def loop_dc(q, k, v, doc, w1, w2, scale):
    """Section 1.10: keys s of t's document with 0 <= t - s < 112; P_h a softmax per head,
    A = sum_h w1[t, h] P_h, head h gains w2[t, h] sum_s A(s) v_h(s)."""
    T, doc = q.shape[0], doc.tolist()
    out = torch.zeros_like(v)
    for t in range(T):
        s = torch.tensor([s for s in range(max(0, t - DC_WINDOW + 1), t + 1) if doc[s] == doc[t]])
        A = sum(w1[t, h] * torch.softmax(scale * (k[s, h] @ q[t, h]), dim=0) for h in range(H))
        for h in range(H):
            out[t, h] = w2[t, h] * (A @ v[s, h])
    return out


def reference_attention(model, i, xn, ve, mudd, doc, coefs, windows):
    """Layer i's attention sublayer in float64 from the fact sheet (section 1.6, in its order).
    mudd = (per-head VE gate, MUDD's V) for layer 10; coefs = the per-token coefficients by kind."""
    T, paired = xn.shape[0], has(i, "paired")
    q, k, v = projections(model, i, xn)
    q, k = rms_norm(q), rms_norm(k)                                        # step 2
    pos, freq = rotary_positions(T, paired), model.rotary_freq.double()
    q, k = rotate(q, pos, freq), rotate(k, pos, freq)                      # step 3.1 / 1.7
    if has(i, "offset"):
        k = key_offset_ref(k)                                              # step 3.2
    table = LAYER_TABLE[i].get("ve")
    if table is not None:                                                  # step 3.3 / 1.7: v += aux_v
        if table == "mudd":                                                # section 1.5: g_ve ve4 + v_mudd
            gate, v_mudd = mudd
            v = v + (gate[..., None] * ve.view(T, H, HD) + v_mudd)
        else:                                                              # 2 sigma(W [xn[:6], ve[:6]])
            w_ve = model.ve_gate_bank[table].double()
            gate = 2 * torch.sigmoid(torch.cat([xn[:, :6], ve[:, :6]], dim=1) @ w_ve.T)
            v = v + gate[..., None] * ve.view(T, H, HD)
    scale = float(model.attn_scale)
    y = loop_attention(q, k, v, doc, windows[has(i, "long")], paired, scale)   # step 5
    if has(i, "dc"):                                                       # step 6
        w1 = rms_norm(coefs["dc_w1"], eps=1e-6)
        y = y + loop_dc(q, k, v, doc, w1, coefs["dc_w2"], scale)
    if has(i, "xsa"):                                                      # step 7
        vv = (v * v).sum(-1, keepdim=True).clamp_min(1e-8)
        y = y - torch.tanh(coefs["xsa"])[..., None] * ((y * v).sum(-1, keepdim=True) / vv) * v
    if has(i, "gate"):                                                     # step 8, linear
        y = y * coefs["gate"][..., None]
    return output_projection(model, i, y)                                  # step 9


# -- 1. index maps ---------------------------------------------------------------------------------

def test_qk_and_vo_bank_index_maps_are_the_records():
    """Section 1.3 on the record's 8-GPU banks: qk_bank (64, 256, 768) with 60-63 padding, vo_bank
    (24, 768, 768) with 20-23 padding (zero at init). Then, with every bank matrix distinct (padding
    included), each layer's q, k, v as they reach the attention kernel and its output projection must be
    the ones the index arithmetic picks. The kernel is replaced by a spy that records q, k, v and returns
    a fixed y, the rotary tables are the identity and the XSA / gate / DC coefficients neutral."""
    model = tg.GPT(RECORD_SMALL, world_size=8)  # bf16, as the record
    assert model.qk_bank.shape == (64, 2 * HD, D) and model.vo_bank.shape == (24, D, D)
    assert (model.qk_bank[60:] == 0).all() and (model.vo_bank[20:] == 0).all()
    for bank, n in ((model.qk_bank, 60), (model.vo_bank, 20)):  # U(-1/32, 1/32), every matrix drawn
        assert (bank[:n].abs().amax(dim=(1, 2)) > 0).all() and bank[:n].abs().max() <= 1 / 32

    model = tg.GPT(RECORD_SMALL, world_size=8, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    T = 12
    with torch.no_grad():
        for p in (model.qk_bank, model.vo_bank):
            p.copy_(0.02 * torch.randn(p.shape, generator=g, dtype=torch.float64))
        model.scalars.copy_(0.5 + torch.rand(model.scalars.shape, generator=g))
    xn = rms_norm(torch.randn(T, D, generator=g, dtype=torch.float64))
    y_kernel = torch.randn(T, H, HD, generator=g, dtype=torch.float64)
    seen = {}

    def spy_attend(q, k, v, mask, paired, chain="long"):
        seen.update(q=q, k=k, v=v, paired=paired)
        return y_kernel

    class Masks(dict):  # records which (long window, slots per token) mask the layer asks for
        def __missing__(self, key):
            seen["mask"] = key

    def neutral(kind, i):  # XSA alpha 0, gate 1, DC w2 0: the kernel's y reaches the projection as is
        return torch.ones(T, H, dtype=torch.float64) if kind == "gate" else torch.zeros(T, H, dtype=torch.float64)

    model._attend = spy_attend
    identity = (torch.ones(T, ROT // 2, dtype=torch.float64), torch.zeros(T, ROT // 2, dtype=torch.float64))
    rope = {"long": {"plain": identity, "paired": tuple(t[:, None].expand(T, H, ROT // 2) for t in identity)}}
    w = {"qk": model.qk_bank.unbind(0), "vo": model.vo_bank.unbind(0)}
    doc = torch.zeros(T, dtype=torch.int64)
    # The model rounds lambda * W to fp32 once (it multiplies the fp32 lambda into the weight, as the
    # record does into its bf16 weight): 1e-6 covers that; a wrong matrix or head is off by O(1).
    close = dict(rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        for i in ATTN_LAYERS:
            out = model._attention(i, xn, None, None, None, doc, rope, Masks(), neutral, w)
            q, k, v = projections(model, i, xn)
            k = rms_norm(k)
            torch.testing.assert_close(seen["q"], rms_norm(q), **close, msg=f"layer {i}: Q")
            torch.testing.assert_close(seen["k"], key_offset_ref(k) if has(i, "offset") else k, **close,
                                       msg=f"layer {i}: K")
            torch.testing.assert_close(seen["v"], v, **close, msg=f"layer {i}: V")
            torch.testing.assert_close(out, output_projection(model, i, y_kernel), **close, msg=f"layer {i}: O")
            assert seen["paired"] == has(i, "paired") and seen["mask"] == (has(i, "long"), 1 + has(i, "paired"))


# -- 2. one attention layer against a loop ---------------------------------------------------------

SHORT_BLOCKS, LONG_BLOCKS = 2, 5     # 32 and 80 tokens (blocks of 16 in RECORD_SMALL); 80 != DC's 112
T_BATCH, STARTS = 256, (0, 60, 61, 200)  # four documents, one of a single token, one longer than 112


@pytest.fixture(scope="module")
def float64_model():
    model = tg.GPT(RECORD_SMALL, world_size=8, dtype=torch.float64)
    randomize(model, seed=5)
    model.set_windows(SHORT_BLOCKS, LONG_BLOCKS)  # a YaRN step: rotary_freq and attn_scale move
    return model


@pytest.mark.parametrize("i", ATTN_LAYERS)
def test_attention_layer_against_a_loop_over_heads_and_keys(float64_model, i):
    """GPT._attention(i) called as GPT.forward calls it (rotary tables, SDPA masks and bank views built
    the same way) on random inputs and per-token coefficients, against reference_attention. RoPE scores
    depend only on relative positions in exact arithmetic, so absolute positions are test 3's."""
    model, T = float64_model, T_BATCH
    _, _, cu = make_batch(T=T, starts=STARTS, vocab=1000)
    doc = tg.document_ids(cu, T)
    assert [int(doc[s]) for s in STARTS] == [0, 1, 2, 3] and int(doc[-1]) == 3
    g = torch.Generator().manual_seed(100 + i)

    def rnd(*shape, std=1.0, mean=0.0):
        return mean + std * torch.randn(*shape, generator=g, dtype=torch.float64)

    xn = rms_norm(rnd(T, D))
    ve = rnd(T, D, std=0.5) if "ve" in LAYER_TABLE[i] else None
    mudd = ve_gate = v_mudd = None
    if LAYER_TABLE[i].get("ve") == "mudd":  # section 1.5: gate [mu6]*3 + [mu7]*3 per token, plus MUDD's V
        mu6, mu7 = rnd(T, 1, std=0.5, mean=2.0), rnd(T, 1, std=0.5, mean=2.0)
        ve_gate, v_mudd = torch.cat([mu6] * 3 + [mu7] * 3, dim=1), rnd(T, H, HD, std=0.5)
        mudd = (ve_gate, v_mudd)
    coefs = {"xsa": rnd(T, H), "gate": rnd(T, H, std=0.3, mean=0.25), "dc_w1": rnd(T, H, std=0.5, mean=1.0),
             "dc_w2": rnd(T, H, std=0.5)}
    asked = set()

    def coef(kind, layer):
        assert layer == i
        asked.add(kind)
        return coefs[kind]

    rope = {"long": tg.rotary_tables(model.rotary_freq, T, H, torch.float64)}  # as GPT.forward builds them
    masks = model.attention_masks(cu, T, "sdpa")
    w = {"qk": model.qk_bank.unbind(0), "vo": model.vo_bank.unbind(0)}
    with torch.no_grad():
        got = model._attention(i, xn, ve, ve_gate, v_mudd, doc, rope, masks, coef, w)
        windows = {False: SHORT_BLOCKS * RECORD_SMALL.window_block_size,
                   True: LONG_BLOCKS * RECORD_SMALL.window_block_size}
        want = reference_attention(model, i, xn, ve, mudd, doc, coefs, windows)
    assert asked == ({"xsa"} if has(i, "xsa") else set()) | ({"gate"} if has(i, "gate") else set()) \
        | ({"dc_w1", "dc_w2"} if has(i, "dc") else set())
    # Tolerance: the model is float64 except its rotary tables (fp32 angles position * freq, off by up
    # to 2^-16 rad at the paired layers' positions < 512) and lambda * W (rounded to fp32 once). These
    # leave differences up to about 3e-6 of the largest output; 2e-5 of it is allowed. A wrong matrix,
    # head, position, slot, window or key offset moves outputs by 1e-2 to 1 of it.
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5 * scale)


# -- 3. rotary tables and apply_rotary --------------------------------------------------------------

def bf16_ulp(x):
    """Spacing of bf16 numbers at |x| (8 significant bits)."""
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -126)))
    return 2.0 ** (e - 7)


def test_rotary_formula_with_unrotated_half():
    """Section 1.15: omega_j = 1024^(-j/31); the bf16 cos/sin tables at packed positions, plain (t) and
    paired (2t + h mod 2, section 1.7), up to position 2 * 262,144 - 1; apply_rotary's formula on dims
    0-63 with dims 64-127 bitwise untouched, in float64 and in bf16."""
    omega = torch.tensor([1024.0 ** (-j / 31) for j in range(ROT // 2)], dtype=torch.float64)
    torch.testing.assert_close(tg.rotary_base_frequencies(HD).double(), omega, rtol=1e-6, atol=0)  # fp32
    freq = omega.float()  # the tables are built from fp32 frequencies

    T = 262_144  # the record's max_seq_len: paired positions reach 2T - 1
    tables = tg.rotary_tables(freq, T, H, torch.bfloat16)
    (cos_p, sin_p), (cos_2, sin_2) = tables["plain"], tables["paired"]
    assert cos_p.shape == (T, ROT // 2) and cos_2.shape == (T, H, ROT // 2) and cos_2.dtype == torch.bfloat16
    tokens = torch.tensor([0, 1, 2, 7, 100, 4097, 65_537, 131_071, 200_003, T - 2, T - 1])
    # The record computes the angle position * omega in fp32 (one rounding of the exact product, up to
    # 2^-6 rad near position 2^19, far more than bf16 resolves), takes cos/sin and stores them in bf16.
    # Reference: that fp32 angle, cos/sin in float64, rounded to bf16 (every sampled entry matches
    # exactly; with the float64 angle the top positions would be off by up to 43 bf16 steps). Allowed:
    # one bf16 step on at most 1% of the entries, where fp32 cos/sin could flip a rounding near a bf16
    # midpoint.

    def check_table(table, want):
        diff = (table.double() - want).abs()
        assert (diff <= bf16_ulp(want)).all() and (diff == 0).double().mean() >= 0.99

    def reference_table(pos):
        angle = (pos.double()[..., None] * freq.double()).float().double()
        return torch.cos(angle).bfloat16().double(), torch.sin(angle).bfloat16().double()

    for tab, want in zip((cos_p[tokens], sin_p[tokens]), reference_table(tokens)):
        check_table(tab, want)
    for tab, want in zip((cos_2[tokens], sin_2[tokens]), reference_table(rotary_positions(T, True)[tokens])):
        check_table(tab, want)
    assert int(rotary_positions(T, True)[tokens].max()) == 2 * T - 1

    g = torch.Generator().manual_seed(0)
    n = len(tokens)
    x = torch.randn(n, H, HD, generator=g, dtype=torch.float64)
    for paired in (False, True):
        pos = rotary_positions(T, paired)[tokens] if paired else tokens[:, None].expand(n, H)
        # float64: exact formula, exact angles
        angle = pos.double()[..., None] * omega
        cs = (torch.cos(angle), torch.sin(angle)) if paired else (torch.cos(angle[:, 0]), torch.sin(angle[:, 0]))
        out = tg.apply_rotary(x, *cs)
        torch.testing.assert_close(out, rotate(x, pos, omega), rtol=0, atol=1e-12)
        assert torch.equal(out[..., ROT:], x[..., ROT:])
        # bf16, with the model's own tables: each product and the sum are rounded to bf16, an error of
        # at most about 2^-8 (|cos x_a| + |sin x_b|) per element
        xb = x.bfloat16()
        c, s = (cos_2[tokens], sin_2[tokens]) if paired else (cos_p[tokens], sin_p[tokens])
        out = tg.apply_rotary(xb, c, s)
        assert out.dtype == torch.bfloat16 and torch.equal(out[..., ROT:], xb[..., ROT:])
        c, s = (c.double(), s.double()) if paired else (c.double()[:, None], s.double()[:, None])
        xd = xb.double()
        a, b = xd[..., 0:ROT:2], xd[..., 1:ROT:2]
        want = torch.stack([c * a + s * b, c * b - s * a], dim=-1).view(n, H, ROT)
        bound = torch.stack([(c * a).abs() + (s * b).abs(), (c * b).abs() + (s * a).abs()], dim=-1).view(n, H, ROT)
        assert ((out[..., :ROT].double() - want).abs() <= 2.0 ** -7 * bound + 1e-30).all()
