"""BOS-aligned loader, validation split and the step schedule."""
import dataclasses
import os
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import train_gpt as tg  # noqa: E402
from train_gpt import BOS_ID  # noqa: E402


def make_corpus(tmp_path, num_shards=3, docs_per_shard=40, seed=0):
    """Shards of documents [BOS, d, d, ...] whose body is the document number d (mod 50000) + 1, with
    lengths 1..300: every token tells which document it came from."""
    rng = np.random.default_rng(seed)
    d = 0
    for s in range(num_shards):
        tokens = []
        for _ in range(docs_per_shard):
            tokens += [BOS_ID] + [d % 50_000 + 1] * int(rng.integers(1, 300))
            d += 1
        tg.write_shard(str(tmp_path / f"c_train_{s + 1:06d}.bin"), tokens)
    return str(tmp_path / "c_train_*.bin")


def test_make_batch_fields():
    buf = np.array([BOS_ID, 5, 6, BOS_ID, 7, BOS_ID, 8, 9, 10], dtype=np.uint16)
    b = tg.make_batch(buf, 1001)
    T = 8
    assert b.inputs.tolist() == buf[:T].tolist() and b.targets.tolist() == buf[1:].tolist()
    assert b.inputs.dtype == torch.int32 and b.targets.dtype == torch.int64
    assert b.cu_seqlens.tolist() == [0, 3, 5] + [T] * (tg.max_docs_for(T) - 2)
    # position 1 hashes with the sentinel 1000 as its previous token (the record's quirk; no int32 wrap here)
    prev = [None, 1000] + [int(buf[t - 1]) for t in range(2, T)]
    expected = [1000] + [(36313 * int(buf[t]) ^ 27191 * prev[t]) % 1000 for t in range(1, T)]
    assert b.ngram_ids.shape == (T, 1) and b.ngram_ids[:, 0].tolist() == expected
    # two channels (record #92's): the bigram over the first half, the trigram's rows after it
    b2 = tg.make_batch(buf, 1001, ngram_channels=2)
    assert b2.ngram_ids.shape == (T, 2) and b2.ngram_ids[:, 0].tolist() == [499] + [
        (36313 * int(buf[t]) ^ 27191 * (499 if t == 1 else int(buf[t - 1]))) % 499 for t in range(1, T)]
    assert b2.ngram_ids[:2, 1].tolist() == [1000, 1000] and b2.ngram_ids[2:, 1].min() >= 500


def test_cu_seqlens_capacity_is_static():
    buf = np.full(33, BOS_ID, dtype=np.uint16)  # 32 one-token documents: more than the capacity
    b = tg.make_batch(buf, 101)
    assert b.cu_seqlens.shape == (tg.max_docs_for(32) + 1,)
    assert b.cu_seqlens[0] == 0 and b.cu_seqlens[-1] == 32
    assert (b.cu_seqlens.diff() >= 0).all()


def doc_of(token):
    return int(token) - 1


def step_batches(pattern, world_size, steps, tokens, max_len, micro):
    """Per step: the micro-batches of every rank, placed at their global slot g (rank = g % world)."""
    loaders = [tg.DocumentLoader(pattern, 1001, r, world_size) for r in range(world_size)]
    out = []
    for _ in range(steps):
        slots = [None] * micro
        for r, loader in enumerate(loaders):
            for j, b in enumerate(loader.next_step(tokens, max_len, micro)):
                slots[r + j * world_size] = b
        out.append(slots)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_take_disjoint_consecutive_documents(tmp_path, world_size):
    pattern = make_corpus(tmp_path)
    single = step_batches(pattern, 1, 6, 256, 128, 4)
    multi = step_batches(pattern, world_size, 6, 256, 128, 4)
    seen = []
    for s1, sw in zip(single, multi):
        for b1, bw in zip(s1, sw):
            assert torch.equal(b1.inputs, bw.inputs) and torch.equal(b1.targets, bw.targets)
            buf = np.concatenate([bw.inputs.numpy(), bw.targets.numpy()[-1:]])
            assert len(buf) == 257 and buf[0] == BOS_ID
            # whole documents, each at most max_len tokens; consecutive document numbers
            starts = list(np.flatnonzero(buf == BOS_ID)) + [len(buf)]
            docs = []
            for a, e in zip(starts[:-1], starts[1:]):
                assert e - a <= 128
                if e - a > 1:
                    docs.append(doc_of(buf[a + 1]))
                    assert (buf[a + 1:e] == buf[a + 1]).all()
            seen += docs
    # documents never repeat and appear in order: consecutive runs from one shared index
    assert seen == sorted(set(seen))


def test_batch_size_and_length_changes_take_effect(tmp_path):
    pattern = make_corpus(tmp_path)
    loader = tg.DocumentLoader(pattern, 1001)
    a = loader.next_step(128, 64, 2)
    b = loader.next_step(512, 200, 2)
    assert [x.inputs.numel() for x in a] == [128, 128] and [x.inputs.numel() for x in b] == [512, 512]
    for batch, limit in ((a, 64), (b, 200)):
        for x in batch:
            buf = np.concatenate([x.inputs.numpy(), x.targets.numpy()[-1:]])
            lengths = np.diff(list(np.flatnonzero(buf == BOS_ID)) + [len(buf)])
            assert lengths.max() <= limit
    assert max(np.diff(list(np.flatnonzero(np.concatenate([x.inputs.numpy() for x in b]) == BOS_ID)))) > 64


def test_loader_state_round_trip_and_shard_wrap(tmp_path):
    pattern = make_corpus(tmp_path, num_shards=2, docs_per_shard=10)
    loader = tg.DocumentLoader(pattern, 1001)
    for _ in range(3):
        loader.next_step(300, 300, 2)
    state = loader.state_dict()
    expected, shards_seen = [], []
    for _ in range(8):  # 8 x 602 tokens: more than the corpus, so it crosses shards and wraps around
        expected.append(loader.next_step(300, 300, 2))
        shards_seen.append(loader.shard)
    assert 1 in shards_seen and shards_seen.index(1) < len(shards_seen) - 1 - shards_seen[::-1].index(0)
    resumed = tg.DocumentLoader(pattern, 1001)
    resumed.load_state_dict(state)
    for batches in expected:
        for x, y in zip(batches, resumed.next_step(300, 300, 2)):
            assert torch.equal(x.inputs, y.inputs) and torch.equal(x.cu_seqlens, y.cu_seqlens)


def test_loader_refuses_other_shards(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pa, pb = make_corpus(tmp_path / "a"), make_corpus(tmp_path / "b", num_shards=2)
    state = tg.DocumentLoader(pa, 1001).state_dict()
    with pytest.raises(SystemExit, match="other training shards"):
        tg.DocumentLoader(pb, 1001).load_state_dict(state)


def test_validation_same_tokens_any_world_size(tmp_path):
    tokens = np.random.default_rng(1).integers(0, 50_000, size=5000)
    tg.write_shard(str(tmp_path / "v_val_000000.bin"), tokens)
    pattern = str(tmp_path / "v_val_*.bin")
    single = tg.validation_batches(pattern, 4096, 512, 1001, 0, 1)
    assert np.concatenate([b.inputs.numpy() for b in single]).tolist() == tokens[:4096].tolist()
    assert np.concatenate([b.targets.numpy() for b in single]).tolist() == tokens[1:4097].tolist()
    for world in (2, 3, 8):
        parts = [tg.validation_batches(pattern, 4096, 512, 1001, r, world) for r in range(world)]
        assert [len(p) for p in parts] == [len(range(r, 8, world)) for r in range(world)]
        assert sorted(b.inputs.tolist() for p in parts for b in p) == sorted(b.inputs.tolist() for b in single)
    with pytest.raises(SystemExit, match="needs 8193 tokens"):
        tg.validation_batches(pattern, 8192, 512, 1001, 0, 1)
    with pytest.raises(SystemExit, match="multiple of the validation sequence length"):
        tg.validation_batches(pattern, 1000, 512, 1001, 0, 1)


# ---------------------------------------------------------------------------------------------- schedule

def test_speedrun_schedule_matches_spec_table():
    args = tg.parse_args([])
    assert tg.stage_bounds(args) == (0, 423, 847, 1270, 1285)  # round(1270/3), round(2540/3): the record's
    assert tg.untie_step(args) == 847 and tg.total_steps(args) == 1285
    expect = {0: (0, 131_072, 896, (1, 3), 1.0), 422: (0, 131_072, 896, (1, 3), 1.0),
              423: (1, 262_144, 2048, (3, 7), 1.52), 846: (1, 262_144, 2048, (3, 7), None),
              847: (2, 393_216, 2048, (5, 11), None), 1270: (3, 393_216, 2048, (6, 13), 0.15),
              1284: (3, 393_216, 2048, (6, 13), 0.15)}
    for step, (stage, batch, doc_len, windows, lr) in expect.items():
        p = tg.plan_step(args, step)
        assert (p.stage, p.batch_tokens, p.max_doc_len, p.windows) == (stage, batch, doc_len, windows)
        if lr is not None:
            assert p.lr_mult == pytest.approx(lr)
    # lr multiplier s(step): the record's table, computed from its rule by hand
    table = {0: 1.0, 422: 1.0, 423: 1.52, 508: 1.52, 700: 1.1748, 846: 0.9123, 847: 1.0271, 1000: 0.7098,
             1269: 0.1521, 1270: 0.15, 1284: 0.15}
    for step, s in table.items():
        assert tg.plan_step(args, step).lr_mult == pytest.approx(s, abs=5e-5), step
    t = (1000 - 508) / 762
    assert tg.plan_step(args, 1000).lr_mult == pytest.approx(1.73 * (1 - t) + 0.15 * t, rel=1e-12)
    assert tg.plan_step(args, 847).lr_mult > tg.plan_step(args, 846).lr_mult  # the jump at stage 3
    # momentum: 0.85 + 0.1 * step/300 until 300, 0.95, then 0.95 - 0.1 * (step - 1235)/50 after 1235
    momenta = {0: 0.85, 150: 0.90, 300: 0.95, 1235: 0.95, 1236: 0.948, 1284: 0.852}
    for step, m in momenta.items():
        assert tg.plan_step(args, step).momentum == pytest.approx(m, abs=1e-12), step
    # MTP weights: linear in (step - stage start) / (stage end - stage start)
    assert tg.plan_step(args, 0).mtp_weights == (1.0, 0.5, 0.25)
    assert tg.plan_step(args, 422).mtp_weights == pytest.approx((1.0, 0.5, 0.25 * (1 - 422 / 423)))
    assert tg.plan_step(args, 423).mtp_weights == (1.0, 0.5, 0.0)
    assert tg.plan_step(args, 846).mtp_weights == pytest.approx((1.0, 0.5 * (1 - 423 / 424), 0.0))
    assert tg.plan_step(args, 900).mtp_weights == (1.0, 0.0, 0.0)
    # compile warm-up: the record's 14 steps
    assert tg.warmup_steps(args) == [0, 1, 421, 422, 423, 424, 845, 846, 847, 848, 1268, 1269, 1270, 1271]
    assert args.final_val_windows == (6, 20)
    assert [tg.plan_step(args, s).do_adam for s in (0, 1, 846, 847)] == [False, True, False, True]


def test_prefix_weight_schedule_is_the_records():
    """Record #89's prefix weight: 0.25 constant in stage 1, 0.25 (1 - t) in stage 2 with
    t = (step - 423) / (847 - 423), 0 in stage 3 and the extension."""
    args = tg.parse_args([])
    for step in (0, 211, 422):
        assert tg.plan_step(args, step).prefix_weight == 0.25, step
    for step in (423, 635, 846):
        t = (step - 423) / (847 - 423)
        assert tg.plan_step(args, step).prefix_weight == pytest.approx(0.25 * (1 - t), abs=1e-15), step
    assert tg.plan_step(args, 635).prefix_weight == pytest.approx(0.125, abs=1e-15)  # mid stage 2: t = 212/424
    for step in (847, 1000, 1269, 1270, 1284):
        assert tg.plan_step(args, step).prefix_weight == 0.0, step
    for preset in ("demo", "test"):  # the small presets train with the term too
        small = tg.parse_args(["--preset", preset])
        assert tg.plan_step(small, 0).prefix_weight == 0.25
        assert tg.plan_step(small, tg.total_steps(small) - 1).prefix_weight == 0.0


def test_small_presets_scale_boundaries():
    args = tg.parse_args(["--preset", "demo", "--num_iterations", "300"])
    assert tg.stage_bounds(args) == (0, 100, 200, 300, 303) and tg.untie_step(args) == 201
    assert tg.plan_step(args, 99).stage == 0 and tg.plan_step(args, 100).stage == 1
    assert tg.plan_step(args, 300).windows == args.stages[-1].windows == (6, 13)
    assert tg.plan_step(args, round(300 * 300 / 1270)).momentum == pytest.approx(0.95)
    assert tg.plan_step(args, tg.total_steps(args) - 1).momentum < 0.86  # cools down to the last step


def test_eta_counts_the_tokens_of_the_steps_left():
    """The ETA is the time per token so far times the tokens of the steps left, counted from the
    stages table: after one stage-1 step of 100 ms, the speedrun's 1,284 steps left are 422 at stage
    1's batch, 424 at twice it and 438 at three times it: 258.4 s, not 1,284 x 0.1 s."""
    args = tg.parse_args([])
    bounds = (0, 423, 847, 1270, 1285)  # the record's stage starts

    def tokens(a, b):  # global tokens of steps a..b-1, stage by stage
        return sum(max(0, min(b, hi) - max(a, lo)) * row.batch_tokens
                   for row, lo, hi in zip(args.stages, bounds, bounds[1:]))

    cumulative = tg.schedule_tokens(args)
    assert len(cumulative) == 1286 and cumulative[-1] == tokens(0, 1285)
    assert tg.eta_seconds(cumulative, 0, 1, 100.0) == pytest.approx(0.1 * (422 + 424 * 2 + 438 * 3))
    for first, done, ms in ((0, 1, 100.0), (0, 500, 4e4), (0, 1000, 1.2e5), (423, 900, 1e5), (850, 1284, 3e5)):
        want = ms / 1000 * tokens(done, 1285) / tokens(first, done)
        assert tg.eta_seconds(cumulative, first, done, ms) == pytest.approx(want)
    assert tg.eta_seconds(cumulative, 0, 1285, 5e5) == 0.0


def test_batch_split_errors():
    args = tg.parse_args([])
    assert [tg.grad_accum_steps(args, w) for w in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    assert tg.check_batch_split(args, 16) == 1
    with pytest.raises(SystemExit, match="does not split into 3 ranks x 3 accumulation steps"):
        tg.check_batch_split(args, 3)


def test_loss_scale_gives_the_records_gradient_for_any_world_size():
    """The record sums the loss over its 8 ranks' tokens (grad_scale 1) and averages gradients over 8
    ranks. With W ranks of 8/W accumulation steps each, scale W/8 gives the same averaged gradient:
    (1/W) * sum over ranks of (W/8) * (sum over that rank's tokens) = (1/8) * sum over all tokens."""
    args = tg.parse_args([])
    for world_size in (1, 2, 4, 8, 16):
        scale = tg.grad_scale_for(args, world_size)
        assert scale == world_size / 8
        accum, ranks = tg.grad_accum_steps(args, world_size), world_size
        # each token's gradient weight after the AVG all-reduce
        assert scale / ranks == pytest.approx(1 / 8) and accum * ranks >= 8


def test_final_validation_is_the_records_one_sequence_per_rank_and_step(tmp_path):
    """Record #89 sections 1.1 and 3.6: 10,485,760 tokens in 5 val steps of 2,097,152; on 8 ranks each
    rank scores one contiguous 262,144-token sequence per step, rank r taking tokens
    [pos + r * 262,144, pos + (r + 1) * 262,144 + 1) with pos advancing 2,097,152 per step."""
    args = tg.parse_args(["--preset", "speedrun"])
    assert (args.val_tokens, args.val_seq_len) == (10_485_760, 262_144)
    stream = np.random.default_rng(0).integers(0, 50257, args.val_tokens + 1, dtype=np.int64)
    stream[::1000] = BOS_ID
    tg.write_shard(str(tmp_path / "fineweb_val_000000.bin"), stream)
    pattern = str(tmp_path / "fineweb_val_*.bin")
    for rank in (0, 3, 7):
        batches = tg.validation_batches(pattern, args.val_tokens, args.val_seq_len, 4001, rank, 8)
        assert len(batches) == 5
        for step, b in enumerate(batches):
            start = step * 2_097_152 + rank * 262_144
            assert b.inputs.numel() == 262_144
            assert np.array_equal(b.inputs.numpy(), stream[start: start + 262_144])
            assert np.array_equal(b.targets.numpy(), stream[start + 1: start + 262_145])
    # the rotary tables reach every position of such a sequence, and paired slots twice as far (2T)
    cos, _ = tg.rotary_tables(tg.rotary_base_frequencies(128), 262_144, 6, torch.float32)["plain"]
    assert cos.shape == (262_144, 32)


# ---- the loader's host-built flex masks, look-ahead and staging buffer ------------------------------

SPEC_ARGS = tg.parse_args(["--preset", "test"])


def test_look_ahead_changes_no_batch_and_no_position(tmp_path):
    """A loader that builds every next step on its thread (and one whose look-ahead is for another
    request, or is abandoned by a resume) hands out exactly the batches of one that builds them on
    demand; its state_dict is the position after the last step it returned."""
    pattern = make_corpus(tmp_path, num_shards=2, docs_per_shard=12)
    requests = [(300, 300, 2), (300, 300, 2), (500, 120, 2), (500, 120, 2), (300, 300, 2)] * 2
    plain, ahead = tg.DocumentLoader(pattern, 1001), tg.DocumentLoader(pattern, 1001)
    for i, request in enumerate(requests):
        want, state = plain.next_step(*request), plain.state_dict()
        got = ahead.next_step(*request)
        if i + 1 < len(requests):
            ahead.look_ahead(*requests[i + 1])
        assert ahead.state_dict() == state  # the look-ahead in flight has not moved the position
        for x, y in zip(want, got):
            assert torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)
            assert torch.equal(x.cu_seqlens, y.cu_seqlens) and torch.equal(x.ngram_ids, y.ngram_ids)
    # a look-ahead for one request, then another request: built again from the same position
    ahead.look_ahead(100, 50, 2)
    state = ahead.state_dict()
    first = ahead.next_step(200, 50, 2)
    plain.load_state_dict(state)
    assert all(torch.equal(x.inputs, y.inputs) for x, y in zip(first, plain.next_step(200, 50, 2)))
    # a resume drops the look-ahead
    ahead.look_ahead(300, 300, 2)
    ahead.load_state_dict(state)
    plain.load_state_dict(state)
    assert all(torch.equal(x.inputs, y.inputs) for x, y in zip(ahead.next_step(300, 300, 2), plain.next_step(300, 300, 2)))


def test_loader_batches_carry_the_flex_masks_of_the_step(tmp_path):
    """With a flex_mask_spec, every batch carries one block mask per attention kind of the layer table,
    built on the host at the spec's windows; their block structure is the brute-force rule's (causal,
    window + 1 slots, same document, in slots for paired rows)."""
    import test_model as tm
    pattern = make_corpus(tmp_path, num_shards=2, docs_per_shard=30)
    bs = 16
    windows = (1, 3)
    spec = tg.flex_mask_spec(SPEC_ARGS, windows)
    block_size, kinds = spec
    assert block_size == tg.FLEX_BLOCK_SIZE
    assert kinds == ((False, 2, windows[0] * SPEC_ARGS.window_block_size),
                     (True, 1, windows[1] * SPEC_ARGS.window_block_size))  # the test table: paired short, long
    spec = (bs, kinds)  # 16-token blocks: several blocks per 128-token batch
    loader = tg.DocumentLoader(pattern, 1001)
    for _ in range(3):
        for b in loader.next_step(128, 60, 2, spec):
            T = b.inputs.numel()
            starts = [s for s in b.cu_seqlens.tolist() if 0 < s < T]
            doc = np.searchsorted(np.array(starts), np.arange(T), side="right")  # documents seen so far
            assert b.doc_ids.dtype == torch.int32 and b.doc_ids.tolist() == doc.tolist()
            assert sorted(b.block_masks) == [(False, 2), (True, 1)]
            for long, r, window in kinds:
                bm = tg.block_attention_mask(b.doc_ids, window, r, bs, indices=b.block_masks[long, r])
                effective, _ = tm.expand_block_mask(bm, T * r, bs)
                assert torch.equal(effective, tm.brute_force_mask(doc, window, r)), (long, r)


def test_model_takes_the_batch_masks_only_at_their_windows(tmp_path):
    """GPT.batch_masks hands the loader's masks to the attention (the same tensors that
    attention_masks computes from cu_seqlens) and refuses a batch built for other windows."""
    pattern = make_corpus(tmp_path, num_shards=2, docs_per_shard=30)
    model = tg.GPT(SPEC_ARGS)
    model.set_windows(2, 5)
    loader = tg.DocumentLoader(pattern, 1001)
    (b,) = loader.next_step(256, 100, 1, tg.flex_mask_spec(SPEC_ARGS, (2, 5)))
    got, want = model.batch_masks(b), model.attention_masks(b.cu_seqlens, 256, kernel="flex")
    assert sorted(got) == sorted(want)
    for key in want:
        for name in tg.BlockMaskIndices._fields:
            field = {"kv_num": "kv_num_blocks", "kv_idx": "kv_indices", "full_kv_num": "full_kv_num_blocks",
                     "full_kv_idx": "full_kv_indices", "q_num": "q_num_blocks", "q_idx": "q_indices",
                     "full_q_num": "full_q_num_blocks", "full_q_idx": "full_q_indices"}[name]
            assert getattr(got[key], field) is getattr(b.block_masks[key], name)
            assert torch.equal(getattr(got[key], field), getattr(want[key], field)), (key, name)
    (stale,) = loader.next_step(256, 100, 1, tg.flex_mask_spec(SPEC_ARGS, (1, 3)))
    with pytest.raises(ValueError, match="batch_masks: the batch's masks were built for"):
        model.batch_masks(stale)
    (plain,) = loader.next_step(256, 100, 1)  # no spec: the model builds its masks (CPU runs)
    assert isinstance(model.batch_masks(plain)[True, 1], tg.SDPAMask)


def test_staged_batch_is_one_buffer_of_aligned_views(tmp_path):
    """stage_batch packs every tensor of a batch (masks included) into one buffer; unstage of a copy of
    it gives back equal tensors, each a view of that copy at a STAGE_ALIGN-aligned offset: the device
    copy of a step is one transfer per micro-batch."""
    pattern = make_corpus(tmp_path, num_shards=2, docs_per_shard=30)
    (b,) = tg.DocumentLoader(pattern, 1001).next_step(256, 100, 1, tg.flex_mask_spec(SPEC_ARGS, (1, 3)))
    staged = tg.stage_batch(b)
    assert staged.staged.dtype == torch.uint8 and staged.staged.dim() == 1
    copy = staged.staged.clone()
    back = tg.unstage(b, copy)
    assert len(tg.batch_tensors(back)) == 5 + 8 * len(b.block_masks)
    for x, y in zip(tg.batch_tensors(b), tg.batch_tensors(back)):
        assert x.dtype == y.dtype and torch.equal(x, y)
        assert y.untyped_storage().data_ptr() == copy.data_ptr()  # a view of the one copy
        assert (y.data_ptr() - copy.data_ptr()) % tg.STAGE_ALIGN == 0
    assert back.mask_spec == b.mask_spec and back.staged is None
    on_meta = staged.to(torch.device("meta"))  # a non-CPU device: views of one copied buffer
    assert all(t.device.type == "meta" and t.untyped_storage().nbytes() == staged.staged.numel()
               for t in tg.batch_tensors(on_meta))
    assert b.to(torch.device("cpu")) is b


def test_attention_kernel_per_kind_decides_which_masks_the_loader_builds(tmp_path, monkeypatch):
    """attention_kernels: SDPA on CPUs; on CUDA --attention_kernel for every kind, or with auto the GPU's
    ATTENTION_KERNEL_CHOICE row (flex where it lists nothing). The loader builds block masks for the flex
    kinds only (none: no spec), and batch_masks gives the varlen kinds VarlenMasks over the batch's
    documents (starts and the stage's longest document doubled on paired rows)."""
    import dataclasses
    cuda = torch.device("cuda")
    kinds = tg.attention_kinds(SPEC_ARGS.layers)
    assert kinds == [(False, 2), (True, 1)]
    assert tg.attention_kernels(SPEC_ARGS, torch.device("cpu")) == dict.fromkeys(kinds, "sdpa")
    varlen_args = dataclasses.replace(SPEC_ARGS, attention_kernel="varlen")
    assert tg.attention_kernels(varlen_args, cuda) == dict.fromkeys(kinds, "varlen")
    assert tg.flex_mask_spec(SPEC_ARGS, (1, 3), tg.attention_kernels(varlen_args, cuda)) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    assert tg.attention_kernels(SPEC_ARGS, cuda) == dict.fromkeys(kinds, "flex")  # auto, no row for this GPU
    monkeypatch.setitem(tg.ATTENTION_KERNEL_CHOICE, "Some GPU", {(False, 2): "varlen"})
    mixed = tg.attention_kernels(SPEC_ARGS, cuda)
    assert mixed == {(False, 2): "varlen", (True, 1): "flex"}
    spec = tg.flex_mask_spec(SPEC_ARGS, (1, 3), mixed)
    assert spec == (tg.FLEX_BLOCK_SIZE, ((True, 1, 3 * SPEC_ARGS.window_block_size),))
    pattern = make_corpus(tmp_path, num_shards=2, docs_per_shard=30)
    (b,) = tg.DocumentLoader(pattern, 1001).next_step(256, 100, 1, spec)
    assert sorted(b.block_masks) == [(True, 1)] and b.max_doc_len == 100
    model = tg.GPT(SPEC_ARGS)
    model.set_windows(1, 3)
    monkeypatch.setattr(tg, "attention_kernels", lambda args, device: mixed)  # the batch's CPU tensors, the CUDA choice
    masks = model.batch_masks(b)
    assert isinstance(masks[True, 1], tg.BlockMask) and masks[True, 1].kv_indices is b.block_masks[True, 1].kv_idx
    paired = masks[False, 2]
    assert isinstance(paired, tg.VarlenMask)
    assert torch.equal(paired.cu_seqlens, 2 * b.cu_seqlens) and paired.cu_seqlens.dtype == torch.int32
    assert (paired.max_seqlen, paired.window) == (200, SPEC_ARGS.window_block_size)


def record92_args():
    """The record92 preset: RECORD92_STAGES as record #92 runs them (1,174 scheduled steps, 20 more, cooldown
    from 0.2 x 1,174) and its candidate counts: 10,240 until step 681, 14,336 until 965, 24,576 until 1,107,
    then all."""
    args = tg.parse_args(["--preset", "record92"])
    assert (args.stages, args.num_iterations, args.extension_iterations, args.cooldown_start) == (
        tg.RECORD92_STAGES, 1174, 20, 0.2)
    return args


def test_record_92s_schedule_rows_give_its_published_numbers():
    """#92's log and fact sheet: stage ends 0, 320, 681, 1107, 1174, 1194; lr 1.40838 at step 320, 1.04999
    at 681, 0.40345 at 1,106, 0.39118 at 1,107, 0.30 from 1,174; the untie at 1,175; the prefix term 0.25,
    then 0.20 / 0.15 / 0.10 / 0.05 flipping at 411, 501 and 591, 0 from 681; and its nine capture keys (the
    shapes and numbers a step's graph freezes) first seen at steps 0, 320, 411, 501, 591, 681, 965, 1107, 1174."""
    args = record92_args()
    assert tg.stage_bounds(args) == (0, 320, 681, 1107, 1174, 1194)
    for step, lr in ((320, 1.40838), (681, 1.04999), (1106, 0.40345), (1107, 0.39118), (1174, 0.30), (1193, 0.30)):
        assert tg.plan_step(args, step).lr_mult == pytest.approx(lr, abs=5e-6), step
    assert tg.plan_step(args, 233).lr_mult == 1.0 and tg.untie_step(args) == 1175
    prefix = {step: tg.plan_step(args, step).prefix_weight for step in range(1194)}
    assert {prefix[s] for s in range(320)} == {0.25} and {prefix[s] for s in range(681, 1194)} == {0.0}
    flips = [s for s in range(321, 681) if prefix[s] != prefix[s - 1]]
    assert flips == [411, 501, 591] and [prefix[s] for s in (320, 411, 501, 591)] == pytest.approx([0.2, 0.15, 0.1, 0.05])

    def key(step):
        plan = tg.plan_step(args, step)
        heads = sum(w > 0 for w in args.stages[plan.stage].mtp_start)
        return plan.batch_tokens, plan.max_doc_len, plan.windows, plan.candidates, plan.prefix_weight, heads
    firsts = [s for s in range(1194) if s == 0 or key(s) != key(s - 1)]
    assert firsts == [0, 320, 411, 501, 591, 681, 965, 1107, 1174]
    assert tg.untie_step(tg.parse_args([])) == 847  # the speedrun's untie row: its last scheduled stage


def test_record_92s_table_cadence():
    """--table_cadence (336/1174, 4, 3): the value embeddings and the n-gram table step on the odd steps
    before 336, then on the steps = 3 mod 4, with squared betas and doubled decay (#92's), holding their
    gradients between; the other Adam labels keep every odd step. The blends' value-embedding average then
    ticks 62 times."""
    args = record92_args()  # the preset's cadence: (336 / 1174, 4, 3)
    plans = [tg.plan_step(args, s) for s in range(1194)]
    updated = [p.step for p in plans if p.do_adam and "value_embeds" not in p.held]
    assert updated == [s for s in range(1194) if s % 2 == 1 and (s < 336 or s % 4 == 3)]
    assert all(p.stretch == ((("value_embeds", 2.0), ("bigram_embed", 2.0)) if p.step >= 336 else ()) for p in plans)
    assert all(p.held in ((), ("value_embeds", "bigram_embed")) for p in plans)
    blends = tg.WeightBlends({label: torch.zeros(2) for label in ("lm_head", "embed", "vo_bank", "mlp_bank",
                                                                  "value_embeds", "qk_bank")}, 1194)
    for p in plans:
        blends.tick(p.step, p.do_adam and "value_embeds" not in p.held)
    assert blends.ticks["value_embed_average"] == 62
    with pytest.raises(SystemExit, match="--table_cadence"):
        tg.check_flags(dataclasses.replace(args, table_cadence=(0.2862, 4, 2)), 1)


def test_virtual_seq_cap_splits_long_documents_for_attention_only():
    """Record #92's virtual sequence cap (2,560 there, 4 here): documents of 10, 3 and 6 tokens (starting at
    0, 10, 13; T = 19) get attention segments starting at 0, 4, 8 | 10 | 13, 17; the tokens and the n-gram
    rows (which run across documents) are those of the uncapped batch, and varlen's longest segment is 4."""
    buf = np.array([BOS_ID, *range(1, 10), BOS_ID, 1, 2, BOS_ID, *range(1, 6), 7], dtype=np.uint16)
    capped, plain = tg.make_batch(buf, 1001, max_doc_len=16, virtual_seq_cap=4), tg.make_batch(buf, 1001, max_doc_len=16)
    T = 19
    assert capped.cu_seqlens.tolist() == [0, 4, 8, 10, 13, 17] + [T] * (tg.max_docs_for(T) - 5)
    assert plain.cu_seqlens.tolist()[:4] == [0, 10, 13, T]
    assert torch.equal(capped.inputs, plain.inputs) and torch.equal(capped.ngram_ids, plain.ngram_ids)
    assert capped.max_doc_len == 4 and plain.max_doc_len == 16
    with pytest.raises(SystemExit, match="--virtual_seq_cap -1 must be >= 0"):
        tg.check_flags(tg.parse_args(["--preset", "test", "--virtual_seq_cap=-1"]), 1)
