"""Shard format, tokenizer script, FineWeb download script, embedded demo data and run.sh."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import train_gpt  # noqa: E402
from train_gpt import BOS_ID, ShardError, read_shard, read_shard_header, write_shard  # noqa: E402

SHAKESPEARE = os.path.join(ROOT, "data", "tinyshakespeare", "tinyshakespeare.txt")
DEMO_DIR = os.path.join(ROOT, "data", "tinyshakespeare")


sys.path.insert(0, os.path.join(ROOT, "data"))  # importable by name, so that worker processes find it too
import cached_fineweb10B as cached_fineweb  # noqa: E402
import sympy_source  # noqa: E402
import tokenize_text  # noqa: E402


# ---------------------------------------------------------------------------------------------- shards

def test_shard_round_trip(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 2**16, size=10_001)
    path = str(tmp_path / "a.bin")
    write_shard(path, tokens)
    assert os.path.getsize(path) == 1024 + 2 * len(tokens)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert list(header[:3]) == [20240520, 1, len(tokens)] and not header[3:].any()
    assert read_shard_header(path) == len(tokens)
    assert np.array_equal(read_shard(path).numpy().astype(np.int64), tokens)
    assert not [f for f in os.listdir(tmp_path) if f != "a.bin"], "temporary file left behind"


def test_write_shard_refuses_out_of_range(tmp_path):
    with pytest.raises(ValueError, match="uint16"):
        write_shard(str(tmp_path / "a.bin"), [1, 70000])


def _corrupt(path, kind):
    data = bytearray(open(path, "rb").read())
    if kind == "magic":
        data[0:4] = np.int32(12345).tobytes()
    elif kind == "version":
        data[4:8] = np.int32(7).tobytes()
    elif kind == "count":
        data[8:12] = np.int32(99).tobytes()
    elif kind == "truncated":
        data = data[:-3]
    elif kind == "empty":
        data = b""
    elif kind == "short":
        data = data[:100]
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("kind,message", [
    ("magic", "bad magic 12345"), ("version", "unsupported shard version 7"),
    ("count", "header says 99 tokens"), ("truncated", "truncated or corrupt"),
    ("empty", "empty file"), ("short", "shorter than the 1024-byte header"),
])
def test_malformed_shard_one_line_error(tmp_path, kind, message):
    path = str(tmp_path / "bad.bin")
    write_shard(path, np.arange(100))
    _corrupt(path, kind)
    with pytest.raises(ShardError) as e:
        read_shard(path)
    text = str(e.value)
    assert message in text and path in text and "\n" not in text


def test_missing_shards_name_the_command(tmp_path):
    with pytest.raises(SystemExit, match="cached_fineweb10B.py"):
        train_gpt.find_shards(str(tmp_path / "fineweb_train_*.bin"), "train")
    with pytest.raises(SystemExit, match="tokenize_text.py"):
        train_gpt.find_shards(str(tmp_path / "mine_*.bin"), "val")


# ---------------------------------------------------------------------------------------------- tokenizer

def test_offline_encoding_matches_known_counts():
    enc = train_gpt.gpt2_encoding()
    text = open(SHAKESPEARE).read()
    cut = int(len(text) * 0.9)
    assert len(enc.encode_ordinary(text[:cut])) == 301_966
    assert len(enc.encode_ordinary(text[cut:])) == 36_059
    assert enc.decode(enc.encode_ordinary(text)) == text
    assert enc.encode("<|endoftext|>", allowed_special="all") == [BOS_ID]


def test_encoding_refuses_wrong_rank_file(tmp_path):
    bad = tmp_path / "gpt2.tiktoken"
    bad.write_text("IQ== 0\n")
    with pytest.raises(SystemExit, match="sha256"):
        train_gpt.gpt2_encoding(str(bad))


def brute_force_prefix(vocab: dict, token_bytes: bytes) -> int:
    """Id of the longest proper prefix of token_bytes among all of vocab (bytes -> id), -1 if none."""
    best, best_len = -1, 0
    for piece, token in vocab.items():
        if best_len < len(piece) < len(token_bytes) and token_bytes.startswith(piece):
            best, best_len = token, len(piece)
    return best


def test_prefix_table_matches_a_brute_force_search():
    """Record #89's prefix table: table[T] = longest proper byte-prefix of token T that is a token, -1 for
    single bytes, BOS and pads; checked against a search over the whole decoded vocabulary."""
    import torch
    enc = train_gpt.gpt2_encoding()
    t = time.perf_counter()
    table = train_gpt.build_prefix_table(enc, 50304)
    seconds = time.perf_counter() - t
    assert seconds < 2.0, f"{seconds:.2f}s: it runs inside the timed region"
    assert table.dtype == torch.int64 and table.shape == (50304,)
    vocab = {enc.decode_single_token_bytes(i): i for i in range(BOS_ID)}
    rng = np.random.default_rng(0)
    tokens = [262, 290, 464, 1169, 50255] + rng.integers(256, BOS_ID, 20).tolist()
    for token in tokens:
        assert table[token] == brute_force_prefix(vocab, enc.decode_single_token_bytes(token)), token
    # known GPT-2 pairs: " the" -> " th", "The" -> "Th", " gazed" -> " gaze"
    for word, prefix in ((" the", " th"), ("The", "Th"), (" gazed", " gaze")):
        (token,), (want,) = enc.encode_ordinary(word), enc.encode_ordinary(prefix)
        assert table[token] == want, word
    singles = [i for i, piece in enumerate(vocab) if len(piece) == 1]
    assert len(singles) == 256 and (table[singles] == -1).all()
    assert table[BOS_ID] == -1 and (table[BOS_ID + 1:] == -1).all()  # BOS and the 47 pad ids
    # every multi-byte token has one (its first byte at least), and every entry is a proper prefix
    assert int((table[:BOS_ID] == -1).sum()) == 256
    for token, piece in enumerate(vocab):
        if len(piece) > 1:
            prefix = enc.decode_single_token_bytes(int(table[token]))
            assert len(prefix) < len(piece) and piece.startswith(prefix), token
    # a smaller vocabulary only names its own columns
    small = train_gpt.build_prefix_table(enc, 1024)
    assert small.shape == (1024,) and small.max() < 1024
    small_vocab = {piece: i for piece, i in vocab.items() if i < 1024}
    for token in (262, 290, 464, 1000):
        assert small[token] == brute_force_prefix(small_vocab, enc.decode_single_token_bytes(token))
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="padded_vocab_size"):
            train_gpt.build_prefix_table(enc, bad)


def test_tokenizer_script_plain_split(tmp_path):
    """The plain 90/10 character split, one document per part: the known counts plus one BOS each."""
    tokenize_text.main([SHAKESPEARE, "--name", "ts", "--out_dir", str(tmp_path), "--split_by", "chars",
                        "--val_fraction", "0.1", "--workers", "1"])
    train = read_shard(str(tmp_path / "ts_train_000001.bin")).numpy()
    val = read_shard(str(tmp_path / "ts_val_000000.bin")).numpy()
    assert len(train) == 301_966 + 1 and len(val) == 36_059 + 1
    assert train[0] == BOS_ID and val[0] == BOS_ID
    assert (train == BOS_ID).sum() == 1 and (val == BOS_ID).sum() == 1
    enc = train_gpt.gpt2_encoding()
    text = open(SHAKESPEARE).read()
    assert enc.decode(train[1:].tolist()) + enc.decode(val[1:].tolist()) == text


def test_tokenizer_documents_workers_and_shards(tmp_path):
    """Delimited documents each start with BOS; 1 and 2 workers give identical shards; shards cut at BOS."""
    text = open(SHAKESPEARE).read()[:60_000]
    src = tmp_path / "in.txt"
    src.write_text(text)
    outputs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        tokenize_text.main([str(src), "--name", "x", "--out_dir", str(out), "--delimiter", r"\n\n",
                            "--val_fraction", "0.1", "--workers", str(workers), "--shard_tokens", "4000"])
        outputs.append({f: open(out / f, "rb").read() for f in sorted(os.listdir(out))})
    assert outputs[0] == outputs[1]
    names = sorted(outputs[0])
    assert names[0] == "x_train_000001.bin" and "x_val_000000.bin" in names and len(names) > 3
    docs = [d for d in text.split("\n\n") if d.strip()]
    enc = train_gpt.gpt2_encoding()
    n_val = int(round(len(docs) * 0.1))
    train_stream = np.concatenate([read_shard(str(tmp_path / "w1" / f)).numpy()
                                   for f in names if "_train_" in f])
    for f in names:
        shard = read_shard(str(tmp_path / "w1" / f)).numpy()
        assert shard[0] == BOS_ID and len(shard) <= 4000
    expected = []
    for d in docs[:len(docs) - n_val]:
        expected += [BOS_ID] + enc.encode_ordinary(d)
    assert train_stream.tolist() == expected


def test_tokenizer_jsonl(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "Hello world."}\n\n{"text": "Second doc", "id": 2}\n{"text": "third"}\n')
    tokenize_text.main([str(src), "--name", "j", "--out_dir", str(tmp_path), "--val_fraction", "0.34", "--workers", "1"])
    enc = train_gpt.gpt2_encoding()
    train = read_shard(str(tmp_path / "j_train_000001.bin")).tolist()
    val = read_shard(str(tmp_path / "j_val_000000.bin")).tolist()
    assert train == [BOS_ID] + enc.encode_ordinary("Hello world.") + [BOS_ID] + enc.encode_ordinary("Second doc")
    assert val == [BOS_ID] + enc.encode_ordinary("third")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:1: .*--jsonl_field"):
        tokenize_text.main([str(bad), "--name", "b", "--out_dir", str(tmp_path)])


def test_pack_documents():
    assert tokenize_text.pack_documents(["aa", "bb", "cccc", "d"], "|", 5) == ["aa|bb", "cccc", "d"]


# ---------------------------------------------------------------------------------------------- demo data

def test_embedded_demo_shards():
    """The committed demo shards are valid, BOS-aligned and are the README's command output."""
    train = read_shard(os.path.join(DEMO_DIR, "tinyshakespeare_train_000001.bin")).numpy()
    val = read_shard(os.path.join(DEMO_DIR, "tinyshakespeare_val_000000.bin")).numpy()
    assert (len(train), len(val)) == (301_698, 36_032)
    assert ((train == BOS_ID).sum(), (val == BOS_ID).sum()) == (270, 29)
    assert train[0] == BOS_ID and val[0] == BOS_ID
    enc = train_gpt.gpt2_encoding()
    assert enc.decode(train[1:50].tolist()).startswith("First Citizen:\nBefore we proceed")


# ---------------------------------------------------------------------------------------------- FineWeb script

def fake_wheel(path, files):
    import zipfile
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return str(path)


def test_sympy_corpus_split_and_documents(tmp_path):
    """Held-out files are the last 2% in SHA-256-of-path order (at least one); files are cut at blank
    lines into documents of at most 2,000 characters unless one block is longer; empty files dropped."""
    import hashlib
    block = lambda i, n: f"def f{i}():\n" + "    x = 1\n" * n  # noqa: E731  a block of 10 + 10 n characters
    files = {f"sympy/m{i}.py": "\n\n".join(block(j, 30) for j in range(i + 1)) for i in range(60)}
    files["sympy/empty/__init__.py"] = ""
    files["sympy/big.py"] = block(0, 300)      # one 3,010-character block: stays whole
    files["sympy/notes.txt"] = "not python"
    wheel = fake_wheel(tmp_path / "w.whl", files)
    order = sorted((n for n in files if n.endswith(".py") and files[n]), key=lambda n: hashlib.sha256(n.encode()).hexdigest())
    train, val = sympy_source.split(sympy_source.source_documents(wheel, ""), 0.02)
    held = order[-1:]                           # 2% of 61 files rounds to 1
    assert "\n\n".join(val) == files[held[0]]
    assert "\n\n".join(train) == "\n\n".join(files[n] for n in order[:-1])
    assert all(len(d) <= 2000 for d in train + val if d != files["sympy/big.py"])
    assert files["sympy/big.py"] in train + val
    assert max(len(d) for d in train if d != files["sympy/big.py"]) > 1500   # packed, not one block each
    main_out = tmp_path / "out"
    sympy_source.main(["--wheel", wheel, "--sha256", "", "--out_dir", str(main_out), "--workers", "1"])
    tokens = read_shard(str(main_out / "sympy_train_000001.bin")).numpy()
    assert int((tokens == BOS_ID).sum()) == len(train) and tokens[0] == BOS_ID


def test_sympy_corpus_refuses_another_wheel(tmp_path):
    wheel = fake_wheel(tmp_path / "w.whl", {"a.py": "x = 1"})
    r = subprocess.run([sys.executable, os.path.join(ROOT, "data", "sympy_source.py"), "--wheel", wheel,
                        "--out_dir", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "is not the pinned sympy==1.14.0 wheel" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    with pytest.raises(SystemExit) as e:  # the same exit, in this process
        sympy_source.main(["--wheel", wheel, "--wheel", str(tmp_path / "none.whl"), "--out_dir", str(tmp_path / "o")])
    assert "cannot read" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "bad.whl").write_bytes(b"not a zip")
    with pytest.raises(SystemExit, match="is not a wheel"):
        sympy_source.source_documents(str(tmp_path / "bad.whl"), "")


def test_fineweb_unreachable_fails_fast(tmp_path):
    env = dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9")  # nothing listens on port 9
    start = time.time()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "data", "cached_fineweb10B.py"), "1",
                        "--local_dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode != 0 and time.time() - start < 10
    assert "cannot reach the Hugging Face hub" in r.stderr and r.stderr.count("\n") == 1


def test_fineweb_download_verifies_and_skips(tmp_path, monkeypatch):
    calls = []

    def fake_download(filename, local_dir):
        calls.append(filename)
        write_shard(os.path.join(local_dir, filename), np.full(1000, 7))

    monkeypatch.setattr(cached_fineweb, "download_file", fake_download)
    monkeypatch.setattr(cached_fineweb, "check_hub_reachable", lambda: None)
    paths = cached_fineweb.fetch(2, str(tmp_path))
    assert calls == ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert [read_shard_header(p) for p in paths] == [1000] * 3
    calls.clear()
    open(paths[2], "r+b").truncate(2000)  # a partial file is fetched again, complete ones are skipped
    cached_fineweb.fetch(2, str(tmp_path))
    assert calls == ["fineweb_train_000002.bin"]

    def broken_download(filename, local_dir):
        open(os.path.join(local_dir, filename), "wb").write(b"<html>not found</html>")

    monkeypatch.setattr(cached_fineweb, "download_file", broken_download)
    with pytest.raises(SystemExit, match="downloaded file is bad: .*fineweb_train_000003.bin"):
        cached_fineweb.fetch(3, str(tmp_path))


# ---------------------------------------------------------------------------------------------- run.sh

def test_run_sh_dry_run_on_cpu():
    r = subprocess.run([os.path.join(ROOT, "run.sh"), "--dry-run", "--num_iterations", "5"],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable))  # no .venv, no install
    assert r.returncode == 0, r.stderr
    assert "gpus: 0" in r.stdout
    launch = [line for line in r.stdout.splitlines() if line.startswith("launch:")]
    assert len(launch) == 1
    assert "--nproc_per_node=2 train_gpt.py --preset demo --num_iterations 5" in launch[0]
