"""Turn text into train/val token shards (GPT-2 BPE, every document starting with BOS 50256).

Inputs: plain text files (one document per file, or several separated by --delimiter) and JSONL files
(one document per line, text under --jsonl_field). Works offline with the shipped GPT-2 rank file.

    # the embedded demo data (data/tinyshakespeare/)
    python data/tokenize_text.py data/tinyshakespeare/tinyshakespeare.txt --name tinyshakespeare \
        --out_dir data/tinyshakespeare --split_by chars --val_fraction 0.1 --delimiter '\\n\\n' --pack_chars 4000

    # a JSONL corpus, last 1% of documents as validation, 4 worker processes
    python data/tokenize_text.py corpus.jsonl --name mycorpus --out_dir data/mycorpus --workers 4
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from train_gpt import BOS_ID, GPT2_TIKTOKEN_FILE, gpt2_encoding, write_shard  # noqa: E402

_encoding = None  # one tokenizer per worker process


def _init_worker(rank_file):
    global _encoding
    _encoding = gpt2_encoding(rank_file)


def _encode_documents(docs: list[str]) -> np.ndarray:
    """BOS + tokens for each document, concatenated."""
    out = []
    for doc in docs:
        out.append(BOS_ID)
        out.extend(_encoding.encode_ordinary(doc))
    return np.asarray(out, dtype=np.uint16)


def read_documents(path: str, delimiter: str | None, jsonl_field: str) -> list[str]:
    """Documents of one input file, in order."""
    try:
        if path.endswith((".jsonl", ".json")):
            docs = []
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        docs.append(json.loads(line)[jsonl_field])
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise SystemExit(f"error: {path}:{lineno}: not a JSON object with a {jsonl_field!r} text field"
                                         " (set --jsonl_field)") from None
            return docs
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise SystemExit(f"error: cannot read {path} ({e.strerror})") from None
    except UnicodeDecodeError:
        raise SystemExit(f"error: {path} is not UTF-8 text") from None
    return split_documents(text, delimiter)


def split_documents(text: str, delimiter: str | None) -> list[str]:
    if delimiter is None:
        return [text] if text else []
    return [doc for doc in text.split(delimiter) if doc.strip()]


def pack_documents(docs: list[str], delimiter: str, max_chars: int) -> list[str]:
    """Join consecutive pieces (with the delimiter restored) into documents of up to max_chars, so that
    a text of short paragraphs still gives documents long enough to learn context from."""
    packed, current = [], ""
    for doc in docs:
        if current and len(current) + len(delimiter) + len(doc) > max_chars:
            packed.append(current)
            current = doc
        else:
            current = current + delimiter + doc if current else doc
    if current:
        packed.append(current)
    return packed


def tokenize(docs: list[str], workers: int, rank_file: str | None, chunk_docs: int = 256) -> np.ndarray:
    """Token stream (BOS-started documents) for docs; identical for any number of workers."""
    chunks = [docs[i:i + chunk_docs] for i in range(0, len(docs), chunk_docs)]
    if workers <= 1 or len(chunks) <= 1:
        _init_worker(rank_file)
        parts = [_encode_documents(c) for c in chunks]
    else:
        with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (rank_file,)) as pool:
            parts = pool.map(_encode_documents, chunks)  # map keeps order: output is deterministic
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def write_shards(tokens: np.ndarray, out_dir: str, name: str, split: str, shard_tokens: int) -> list[str]:
    """Cut a token stream into shards at document starts (a document never spans two shards unless it
    alone exceeds shard_tokens). Val shards count from 000000, train shards from 000001."""
    bos = np.flatnonzero(tokens == BOS_ID)
    paths, start, index = [], 0, 0 if split == "val" else 1
    while start < len(tokens):
        end = min(start + shard_tokens, len(tokens))
        if end < len(tokens):
            cut = bos[(bos > start) & (bos <= end)]
            if len(cut):
                end = int(cut[-1])
        path = os.path.join(out_dir, f"{name}_{split}_{index:06d}.bin")
        write_shard(path, tokens[start:end])
        paths.append(path)
        start, index = end, index + 1
    return paths


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="text or .jsonl files")
    p.add_argument("--name", required=True, help="shard name prefix: NAME_train_000001.bin, NAME_val_000000.bin")
    p.add_argument("--out_dir", required=True)
    p.add_argument("--delimiter", default=None,
                   help="split text files into documents at this string (escapes like \\n allowed); default: one document per file")
    p.add_argument("--pack_chars", type=int, default=0,
                   help="join consecutive delimited pieces into documents of up to this many characters (0: off)")
    p.add_argument("--jsonl_field", default="text")
    p.add_argument("--val_fraction", type=float, default=0.01)
    p.add_argument("--split_by", choices=["docs", "chars"], default="docs",
                   help="docs: the last fraction of documents is validation; chars: the last fraction of the "
                        "concatenated text (a single long text file)")
    p.add_argument("--shard_tokens", type=int, default=100_000_000)
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1) - 1))
    p.add_argument("--tiktoken_file", default=GPT2_TIKTOKEN_FILE, help="GPT-2 rank file (offline)")
    p.add_argument("--hub_encoding", action="store_true", help="use tiktoken.get_encoding('gpt2') instead (may download)")
    a = p.parse_args(argv)
    if not 0 <= a.val_fraction < 1:
        p.error(f"--val_fraction {a.val_fraction} must be in [0, 1)")
    if a.shard_tokens <= 0:
        p.error("--shard_tokens must be positive")
    delimiter = a.delimiter.encode().decode("unicode_escape") if a.delimiter is not None else None
    if a.pack_chars and delimiter is None:
        p.error("--pack_chars needs --delimiter")

    if a.split_by == "chars":
        text = "".join(open(path, encoding="utf-8").read() for path in a.inputs)
        cut = int(len(text) * (1 - a.val_fraction))
        train_docs, val_docs = split_documents(text[:cut], delimiter), split_documents(text[cut:], delimiter)
    else:
        docs = [d for path in a.inputs for d in read_documents(path, delimiter, a.jsonl_field)]
        cut = len(docs) - int(round(len(docs) * a.val_fraction))
        train_docs, val_docs = docs[:cut], docs[cut:]
    if a.pack_chars:
        train_docs = pack_documents(train_docs, delimiter, a.pack_chars)
        val_docs = pack_documents(val_docs, delimiter, a.pack_chars)

    os.makedirs(a.out_dir, exist_ok=True)
    rank_file = None if a.hub_encoding else a.tiktoken_file
    for split, docs in (("train", train_docs), ("val", val_docs)):
        if not docs:
            continue
        tokens = tokenize(docs, a.workers, rank_file)
        for path in write_shards(tokens, a.out_dir, a.name, split, a.shard_tokens):
            print(f"{path}: {os.path.getsize(path) // 2 - 512:,} tokens")
        print(f"{split}: {len(docs):,} documents, {len(tokens):,} tokens")


if __name__ == "__main__":
    main()
