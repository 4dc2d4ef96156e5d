"""The data the token-efficiency benchmark gives both sides (tests/benchmarks/token_efficiency.py): the
count-model floor against hand-computed values and a plain-Python reference, the even validation
documents, the per-seed training order, the provenance of saved runs, and the folder checks."""
import hashlib
import json
import math
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import train_gpt as tg

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "benchmarks"))

import token_efficiency as te  # noqa: E402

BOS = tg.BOS_ID


# ---- the count-model floor --------------------------------------------------------------------------

def test_count_floor_by_hand():
    """Vocabulary 5; 30 training tokens, so the last 3 choose the bigram's weight.
    Fit part (27 tokens): 0 3 4, then 0 1 twelve times. Held-out tail: 3 4 2. Its two pairs: 3 -> 4, which
    the fit part's bigram gives 1 (3 is always followed by 4), and 4 -> 2, which it gives 0; the add-one
    unigram gives 4 the probability a = (1 + 1) / (27 + 5) = 1/16. The weight w maximising
    log(w + (1 - w) a) + log((1 - w) b) solves (1 - a)(1 - w) = w + (1 - w) a: w = (1 - 2a) / (2 (1 - a)) = 7/15.
    Refitted on all 30 tokens: counts 0: 13, 1: 12, 3: 2, 4: 2, 2: 1, so the unigram is (c + 1) / 35;
    contexts 0 -> {3: 1, 1: 12}, 1 -> {0: 11, 3: 1}, 3 -> {4: 2}, 4 -> {0: 1, 2: 1}, 2 never a context."""
    train = [0, 3, 4] + [0, 1] * 12 + [3, 4, 2]
    scored = [0, 1, 3, 4, 2, 0]        # predictions 0->1, 1->3, 3->4, 4->2, 2->0
    floor = te.count_floor(np.array(train), np.array(scored), vocab=5)
    w = 7 / 15
    unigram = [13 / 35, 3 / 35, 3 / 35, 2 / 35, 14 / 35]
    bigram = [12 / 13, 1 / 12, 2 / 2, 1 / 2, 0.0]
    assert floor["bigram_weight"] == pytest.approx(w, abs=1e-8)
    assert floor["unigram"] == pytest.approx(-sum(math.log(u) for u in unigram) / 5, rel=1e-12)
    assert floor["bigram"] == pytest.approx(-sum(math.log(w * b + (1 - w) * u) for b, u in zip(bigram, unigram)) / 5,
                                            rel=1e-7)
    assert floor["train_tokens"] == 30


def _reference_floor(train, scored, vocab):
    """The same two models with dictionaries and a plain loop, the weight found by golden-section search
    on the held-out likelihood (not EM)."""
    def fit(tokens):
        uni, pair, ctx = {}, {}, {}
        for t in tokens:
            uni[t] = uni.get(t, 0) + 1
        for p, n in zip(tokens[:-1], tokens[1:]):
            pair[p, n] = pair.get((p, n), 0) + 1
            ctx[p] = ctx.get(p, 0) + 1
        return (lambda n: (uni.get(n, 0) + 1) / (len(tokens) + vocab),
                lambda p, n: pair.get((p, n), 0) / ctx[p] if p in ctx else 0.0)

    cut = len(train) - max(2, round(0.1 * len(train)))
    u, b = fit(train[:cut])
    held = list(zip(train[cut:-1], train[cut + 1:]))
    loglik = lambda w: sum(math.log(w * b(p, n) + (1 - w) * u(n)) for p, n in held)  # noqa: E731
    lo, hi, g = 0.0, 1.0, (math.sqrt(5) - 1) / 2
    for _ in range(200):
        x1, x2 = hi - g * (hi - lo), lo + g * (hi - lo)
        lo, hi = (x1, hi) if loglik(x1) < loglik(x2) else (lo, x2)
    w = (lo + hi) / 2
    u, b = fit(train)
    pairs = list(zip(scored[:-1], scored[1:]))
    return (-sum(math.log(u(n)) for _, n in pairs) / len(pairs),
            -sum(math.log(w * b(p, n) + (1 - w) * u(n)) for p, n in pairs) / len(pairs), w)


def test_count_floor_against_a_plain_loop():
    rng = np.random.default_rng(0)
    # a Markov chain over 40 ids (so bigrams beat unigrams), and scored tokens with ids never trained on
    trans = rng.dirichlet(np.full(40, 0.1), size=40)
    chain = [0]
    for _ in range(3_000):
        chain.append(int(rng.choice(40, p=trans[chain[-1]])))
    scored = chain[2_500:] + [45, 3, 47]
    floor = te.count_floor(np.array(chain[:2_500]), np.array(scored))
    unigram, bigram, w = _reference_floor(chain[:2_500], scored, te.GPT2_VOCAB)
    assert floor["unigram"] == pytest.approx(unigram, rel=1e-10)
    assert floor["bigram_weight"] == pytest.approx(w, abs=1e-6)
    assert floor["bigram"] == pytest.approx(bigram, rel=1e-8)
    assert 0 < floor["bigram"] < floor["unigram"] < math.log(te.GPT2_VOCAB)


# ---- validation documents and training order ----------------------------------------------------------

def _tagged_documents(first_id, count, length):
    """Documents whose tokens name them: BOS, then the document's id repeated."""
    return [np.array([BOS] + [first_id + i] * (length - 1), dtype=np.uint16) for i in range(count)]


def _write_shards(folder, name, per_shard):
    os.makedirs(folder, exist_ok=True)
    for s, docs in enumerate(per_shard):
        tg.write_shard(os.path.join(folder, f"{name}_{s:06d}.bin"), np.concatenate(docs))
    return os.path.join(folder, f"{name}_*.bin")


def test_even_validation_takes_documents_from_every_shard(tmp_path):
    """Three val shards of 10 documents of 50 tokens (ids 0..29). 299 scored tokens need 300 tokens: 6
    documents, the middle ones of 6 equal strides of 30: (2j + 1) * 30 // 12 = 2, 7, 12, 17, 22, 27, two
    from each shard. The first 300 tokens are documents 0..5, all from the first shard."""
    pattern = _write_shards(str(tmp_path), "v", [_tagged_documents(10 * s, 10, 50) for s in range(3)])
    even = te.choose_validation(pattern, "even", 299, 64)
    assert even.how == "even" and even.val_tokens == 299 and len(even.tokens) == 300
    assert [int(t) for t in even.tokens[1::50]] == [2, 7, 12, 17, 22, 27]
    assert even.documents == (6, 30) and even.shards == (3, 3)
    first = te.choose_validation(pattern, "first", 299, 64)
    assert [int(t) for t in first.tokens[1::50]] == [0, 1, 2, 3, 4, 5]
    assert first.documents == (6, 30) and first.shards == (1, 3)
    whole = te.choose_validation(pattern, "even", 5_000, 64)  # more than the 1,500 tokens there: all, whole sequences
    assert whole.how == "whole" and whole.val_tokens == 1_472 and whole.documents == (30, 30)
    assert np.array_equal(whole.tokens, np.concatenate([tg.read_shard(p).numpy() for p in sorted(tmp_path.iterdir())])[:1_473])
    assert even.digest() != first.digest() and even.digest() == te.choose_validation(pattern, "even", 299, 64).digest()


def test_tuning_validation_is_disjoint_from_the_scored_one(tmp_path):
    """The same 30 documents. Even scores 2, 7, 12, 17, 22, 27; the other 24 (0, 1, 3, ..., 29) give the
    tuning set, 6 of them at the middles of 6 strides of 4: positions 2, 6, 10, 14, 18, 22 of that list,
    i.e. documents 3, 8, 13, 18, 23, 28."""
    pattern = _write_shards(str(tmp_path), "v", [_tagged_documents(10 * s, 10, 50) for s in range(3)])
    tune = te.choose_validation(pattern, "tune", 299, 64)
    assert tune.how == "tune" and len(tune.tokens) == 300 and tune.documents == (6, 30)
    assert [int(t) for t in tune.tokens[1::50]] == [3, 8, 13, 18, 23, 28]
    even = te.choose_validation(pattern, "even", 299, 64)
    assert not {int(t) for t in tune.tokens[1::50]} & {int(t) for t in even.tokens[1::50]}
    with pytest.raises(SystemExit, match="--val_set tune: the val documents that --val_set even does not score hold"):
        te.choose_validation(pattern, "tune", 900, 64)  # even takes 19 documents, the other 11 hold 550 tokens
    with pytest.raises(SystemExit, match="--val_set tune: the val shards .* hold 1500 tokens, so --val_set even scores all"):
        te.choose_validation(pattern, "tune", 5_000, 64)  # even would score the whole split: nothing left to tune on
    assert "chosen evenly over those --val_set even does not score" in te.val_text({"val": pattern, **tune.meta()})


def test_tuning_validation_is_as_large_as_the_scored_one_by_default(tmp_path):
    """Without --val_tokens, --val_set tune takes as many tokens as even (EVEN_VAL_TOKENS), not the
    preset's smaller figure: rates chosen on fewer tokens carry more sampling error than the figures they set."""
    pattern = _write_shards(str(tmp_path), "v", [_tagged_documents(0, 200, 1_000)])  # 200,000 tokens
    sizes = {}
    for how in ("even", "tune", "first"):
        flags = types.SimpleNamespace(preset="demo", train="", val=pattern, train_order="file", tokens=1_000,
                                      val_set=how, val_tokens=None)
        sizes[how] = te.BenchData(flags, str(tmp_path / how)).val.val_tokens
    assert sizes == {"even": 65_536, "tune": 65_536, "first": tg.Hyperparameters(**tg.PRESETS["demo"]).val_tokens}


def test_both_sides_score_the_same_validation_tokens(tmp_path):
    """The shard the benchmark writes, read by the recipe's validation_batches and the classic's
    token_stream: the same val_tokens predictions, the chosen documents'. 20 documents of 40 tokens (ids
    0..19); 513 tokens need 13 of them, (2j + 1) * 20 // 26 for j = 0..12, the last one cut to 33 tokens."""
    pattern = _write_shards(str(tmp_path / "src"), "v", [_tagged_documents(10 * s, 10, 40) for s in range(2)])

    class Flags:
        preset, train, val, train_order, val_set, val_tokens, tokens = "test", pattern, pattern, "file", "even", 512, 100
    data = te.BenchData(Flags, str(tmp_path / "data"))
    recipe = tg.validation_batches(data.val_path, 512, 512, 64, rank=0, world_size=1)
    classic = te.token_stream(data.val_path, "val")
    assert np.array_equal(recipe[0].targets.numpy(), classic[1:513])
    assert np.array_equal(classic, data.val.tokens.astype(np.int64))
    assert [int(t) for t in classic[1::40]] == [0, 2, 3, 5, 6, 8, 10, 11, 13, 14, 16, 17, 19]
    assert len(classic) == 513 and classic[-1] == 19


def test_shuffled_training_shards_hold_the_same_documents(tmp_path, monkeypatch):
    """Per seed a permutation of the same documents (seed 0 included), the same for the same seed, and
    the recipe's loader reads them in that order; whole documents per written shard."""
    per_shard = [_tagged_documents(100, 12, 30), _tagged_documents(200, 9, 45)]
    pattern = _write_shards(str(tmp_path / "src"), "t", per_shard)
    original = [int(d[1]) for docs in per_shard for d in docs]
    monkeypatch.setattr(te, "SHARD_TOKENS", 200)  # several written shards
    orders = {}
    for seed in (0, 1, 2):
        glob_ = te.write_training_shards(te.training_documents(pattern, "shuffled", seed), str(tmp_path / f"s{seed}"))
        written = te.shard_documents(glob_, "train")
        assert len(written) > 1 and all(sum(map(len, docs)) <= 200 for docs in written)
        orders[seed] = [int(d[1]) for docs in written for d in docs]
        assert sorted(orders[seed]) == sorted(original)           # the same multiset of documents
        assert all(len(d) == (30 if d[1] < 200 else 45) and d[0] == BOS for docs in written for d in docs)
        loader = tg.DocumentLoader(glob_, 64)
        batch = loader.next_step(12 * 30 + 9 * 45 - 1, 10_000, 1)[0]  # every document, in the loader's order
        seen = [int(t) for t in batch.inputs.numpy() if t != BOS]
        assert list(dict.fromkeys(seen)) == orders[seed]
    assert len({tuple(o) for o in orders.values()}) == 3 and original not in orders.values()
    assert orders[1] == [int(d[1]) for d in te.training_documents(pattern, "shuffled", 1)]
    assert [int(d[1]) for d in te.training_documents(pattern, "file", 5)] == original


# ---- provenance and results folders ---------------------------------------------------------------------

def test_git_commit_marks_uncommitted_changes(tmp_path):
    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()
    assert te.git_commit(str(tmp_path)).startswith("unknown")
    git("init", "-q")
    (tmp_path / "a.txt").write_text("1")
    git("add", "a.txt")
    git("commit", "-q", "-m", "one")
    head = git("rev-parse", "HEAD")
    assert te.git_commit(str(tmp_path)) == head
    (tmp_path / "new.txt").write_text("untracked files do not count")
    assert te.git_commit(str(tmp_path)) == head
    (tmp_path / "a.txt").write_text("2")
    assert te.git_commit(str(tmp_path)) == head + "-dirty"


def test_floor_of_older_runs_is_computed_once_and_saved(tmp_path):
    """Runs that record no floor (file order, the first val_tokens): computed from the shards, saved in
    floor.json, read from there once the shards are gone, and recomputed when the runs differ from it."""
    train = _write_shards(str(tmp_path / "d"), "t", [_tagged_documents(100, 20, 30)])
    val = _write_shards(str(tmp_path / "d"), "v", [_tagged_documents(100, 5, 30)])
    meta = {"tokens": 400, "val_tokens": 64, "train": train, "val": val, "preset": "test"}
    runs = {"recipe_s0": {"curve": [(0, 9.0)], "seed": 0, **meta}, "recipe_s1": {"curve": [(0, 9.0)], "seed": 1, **meta}}
    folder = str(tmp_path / "r")
    os.makedirs(folder)
    floors = te.folder_floors(folder, runs)
    stream = np.concatenate(te.training_documents(train, "file", 0))
    want = te.count_floor(stream[:400], np.concatenate(te.training_documents(val, "file", 0))[:65])
    assert floors.by_seed == {0: want, 1: want} and floors.source.startswith("computed")
    with open(os.path.join(folder, te.FLOOR_FILE), encoding="utf-8") as f:
        saved = json.load(f)
    assert saved["floor"] == want and saved["val_tokens"] == 64 and "commit" in saved
    for f in os.listdir(tmp_path / "d"):
        os.remove(tmp_path / "d" / f)
    again = te.folder_floors(folder, runs)
    assert again.by_seed == {0: want, 1: want} and again.source == "saved in floor.json"
    assert te.read_runs(folder) == {}  # floor.json is not a run
    other = {n: {**r, "val_tokens": 32} for n, r in runs.items()}
    missing = te.folder_floors(folder, other)
    assert missing.by_seed == {} and "no val shards match" in missing.source
    assert te.ratio_refusal({0: 1.0}, missing).startswith("ratio: not stated: no bigram floor")


def test_runs_on_other_data_do_not_mix():
    old = {"train": "t", "val": "v", "val_tokens": 16384}
    new = {"train": "t", "val": "v", "val_tokens": 16384, "val_set": "even", "val_digest": "ab", "train_order": "shuffled"}
    assert te.data_conflict([old, dict(old)]) is None
    assert te.data_conflict([new, dict(new)]) is None
    assert "first" in te.data_conflict([old, new]) and "even" in te.data_conflict([old, new])
    first = {**old, "val_set": "first", "val_digest": "cd", "train_order": "file"}
    assert te.data_conflict([old, first]) is None      # the same definition: the first val_tokens, shards' order
    assert "different contents" in te.data_conflict([first, {**first, "val_digest": "ef"}])
    assert te.data_conflict([new, {**new, "train_order": "file"}]) is not None
    # runs that record both digests compare contents: another spelling of the same shards mixes, the
    # same spelling of other shards does not; one run without the digest falls back to the spellings
    digested = {**new, "train_shards_digest": "12"}
    assert te.data_conflict([digested, {**digested, "train": "t2", "val": "v2"}]) is None
    assert "training shards with different contents (12, 34)" in te.data_conflict(
        [digested, {**digested, "train_shards_digest": "34"}])
    assert "val v2" in te.data_conflict([new, {**digested, "train": "t2", "val": "v2"}])


def test_train_shards_digest_is_the_tokens_not_the_glob(tmp_path):
    """Two shards named by a glob and by the same files' directory spelled another way: one digest, the
    sha256 of both shards' tokens in order, little-endian uint16; one token changed: another digest."""
    per_shard = [_tagged_documents(100, 4, 20), _tagged_documents(200, 3, 30)]
    pattern = _write_shards(str(tmp_path / "src"), "t", per_shard)
    want = hashlib.sha256(b"".join(np.concatenate(docs).astype("<u2").tobytes() for docs in per_shard)).hexdigest()[:16]

    def data(train):
        flags = types.SimpleNamespace(preset="test", train=train, val=pattern, train_order="shuffled",
                                      tokens=100, val_set="first", val_tokens=64)
        return te.BenchData(flags, str(tmp_path / "data"))
    assert data(pattern).train_shards_digest() == want
    spelled_otherwise = data(str(tmp_path / "src" / ".." / "src" / "t_00000[01].bin"))
    assert spelled_otherwise.train_shards_digest() == want
    folder = str(tmp_path / "results")  # --save: a folder's runs take a new run of the same shards, however spelled
    te.save_curve(folder, "recipe_s0", [(0, 10.8)], {"tokens": 100, "preset": "test", **data(pattern).meta(0)})
    width = tg.Hyperparameters(**tg.PRESETS["test"]).model_dim
    te.check_folder(folder, spelled_otherwise, 0, width)
    per_shard[1][2][5] += 1
    _write_shards(str(tmp_path / "src"), "t", per_shard)
    assert data(pattern).train_shards_digest() != want
    with pytest.raises(SystemExit, match="holds runs on other data .training shards with different contents"):
        te.check_folder(folder, data(pattern), 0, width)


def test_results_folder_logs_are_not_ignored():
    """A results folder's run logs are committed with it; the top-level logs/ of training runs is not."""
    def ignored(path):
        out = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO, capture_output=True)
        if out.returncode == 128:
            pytest.skip("not a git checkout")
        return out.returncode == 0
    assert not ignored("records/some_results/logs/recipe_s0_1.txt")
    assert ignored("logs/3f1c.txt")


def test_floor_flag_prints_each_seeds_floor(capsys):
    """--floor on the demo shards: the evenly chosen validation documents (the whole split here: it
    holds fewer than 65,536 tokens) and, per seed, the floor of the first --tokens tokens in that seed's
    document order, built here from the shard directly."""
    te.main(["--floor", "--tokens", "20000", "--seeds", "0,3"])
    out = capsys.readouterr().out
    val_path = os.path.join(REPO, "data", "tinyshakespeare", "tinyshakespeare_val_000000.bin")
    val = tg.read_shard(val_path).numpy()
    scored = val[:(len(val) - 1) // 1024 * 1024 + 1]
    assert f"val: all of data/tinyshakespeare/tinyshakespeare_val_*.bin, {len(scored) - 1:,} tokens" in out
    train = tg.read_shard(os.path.join(REPO, "data", "tinyshakespeare", "tinyshakespeare_train_000001.bin")).numpy()
    starts = [i for i, t in enumerate(train) if t == BOS]
    docs = [train[a:b] for a, b in zip(starts, starts[1:] + [len(train)])]
    for seed in (0, 3):
        order = np.random.default_rng(seed).permutation(len(docs))
        floor = te.count_floor(np.concatenate([docs[i] for i in order])[:20_000], scored)
        assert (f"seed {seed}: unigram {floor['unigram']:.4f}, interpolated bigram {floor['bigram']:.4f} "
                f"(weight {floor['bigram_weight']:.3f})") in out


@pytest.mark.parametrize("code, saved", [(143, False), ("non-finite loss at step 3", True)])
def test_an_ablation_a_signal_stops_is_not_saved_as_a_result(monkeypatch, tmp_path, code, saved):
    """A diverging ablation row is a result (NaN final loss); one stopped by SIGTERM (train_gpt exits
    128 + 15 after saving its state) is not: saving it would end the run, and its rerun would skip it."""
    def run_recipe(*_, **__):
        raise SystemExit(code)
    monkeypatch.setattr(te, "run_recipe", run_recipe)
    monkeypatch.setattr(te, "recipe_cpu_dtype", lambda *_: ("fp32", "recipe dtype fp32"))
    monkeypatch.setattr(te, "run_copy", lambda files, *_: files)
    monkeypatch.setattr(te, "run_meta", lambda *_: {})
    monkeypatch.setattr(te, "this_sitting", lambda a: {"commit": "c0ffee", "command": ["token_efficiency.py"]})
    a = types.SimpleNamespace(save=str(tmp_path), cpu_dtype="fp32", data_dir=str(tmp_path), tokens=1000)
    args = tg.Hyperparameters(log_dir=str(tmp_path))
    os.makedirs(tmp_path / te.PARTIAL_DIR / "ablate_x_s0")
    if saved:
        curve = te.save_recipe_run(a, None, 0, None, "ablate_x_s0", args, {}, diverging_is_a_result=True)
        assert math.isnan(curve[-1][1])
    else:
        with pytest.raises(SystemExit) as e:
            te.save_recipe_run(a, None, 0, None, "ablate_x_s0", args, {}, diverging_is_a_result=True)
        assert e.value.code == 143
    assert os.path.exists(tmp_path / "ablate_x_s0.json") == saved
    assert os.path.isdir(tmp_path / te.PARTIAL_DIR / "ablate_x_s0") != saved  # a stopped run's state stays
