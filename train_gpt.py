"""Speedrun GPT training: one file, read top to bottom in the order data flows.

    torchrun --standalone --nproc_per_node=8 train_gpt.py            # 8xH100 speedrun
    torchrun --standalone --nproc_per_node=2 train_gpt.py --preset demo   # CPU demo (gloo)
    python train_gpt.py --help                                         # every knob

Importing this file has no side effects (tests and data scripts import it): the process group,
devices, files and compilation all start in main().
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import triton_kernels

# ----------------------------------------------------------------------------------------------
# Hyperparameters: one dataclass, three presets
# ----------------------------------------------------------------------------------------------


@dataclass
class Hyperparameters:
    # data
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"
    val_tokens: int = 10_485_760  # validation always covers exactly these tokens, for any world size
    # model (SPEC section 3)
    vocab_size: int = 50257
    padded_vocab_size: int = 50304
    num_layers: int = 11
    model_dim: int = 768
    num_heads: int = 6
    head_dim: int = 128
    mlp_hidden: int = 3072
    bigram_vocab_size: int = 377_280
    # run
    seed: int = 0
    run_id: str = ""  # empty: a fresh uuid per run


# Presets override the speedrun defaults. "demo" trains on a CPU in minutes, "test" is tiny.
PRESETS: dict[str, dict] = {
    "speedrun": {},
    "demo": dict(
        train_files="data/tinyshakespeare/tinyshakespeare_train_*.bin",
        val_files="data/tinyshakespeare/tinyshakespeare_val_*.bin",
        val_tokens=32_768,
        num_layers=6, model_dim=256, num_heads=4, head_dim=64, mlp_hidden=1024,
        bigram_vocab_size=50_021,
    ),
    "test": dict(
        train_files="data/tinyshakespeare/tinyshakespeare_train_*.bin",
        val_files="data/tinyshakespeare/tinyshakespeare_val_*.bin",
        val_tokens=4096,
        num_layers=4, model_dim=64, num_heads=2, head_dim=32, mlp_hidden=256,
        bigram_vocab_size=4_001,
    ),
}


def _parse_value(name: str, text: str, default):
    """Parse a command-line value into the type of the field's default."""
    try:
        if isinstance(default, bool):
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if isinstance(default, tuple):
            import ast
            value = ast.literal_eval(text)
            return tuple(value) if isinstance(value, (list, tuple)) else (value,)
        return type(default)(text)
    except (ValueError, SyntaxError):
        kind = "true/false" if isinstance(default, bool) else type(default).__name__
        raise SystemExit(f"error: --{name} {text!r} is not a valid {kind} (default: {default!r})")


def parse_args(argv: list[str] | None = None) -> Hyperparameters:
    """`--preset NAME` then `--field value` overrides for any Hyperparameters field."""
    defaults = Hyperparameters()
    parser = argparse.ArgumentParser(
        description="Speedrun GPT training. Any hyperparameter can be overridden: --field value.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default="speedrun", choices=sorted(PRESETS),
                        help="base configuration the overrides apply to")
    for f in dataclasses.fields(Hyperparameters):
        parser.add_argument(f"--{f.name}", default=None, metavar=type(getattr(defaults, f.name)).__name__.upper(),
                            help=f"(speedrun default: {getattr(defaults, f.name)!r})")
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        raise SystemExit(f"error: unknown argument {unknown[0]!r}; `python train_gpt.py --help` lists every field")
    args = dataclasses.replace(defaults, **PRESETS[ns.preset])
    overrides = {}
    for f in dataclasses.fields(Hyperparameters):
        text = getattr(ns, f.name)
        if text is not None:
            overrides[f.name] = _parse_value(f.name, text, getattr(args, f.name))
    return dataclasses.replace(args, **overrides)


# ----------------------------------------------------------------------------------------------
# Distributed setup
# ----------------------------------------------------------------------------------------------

# (filled in with the training loop)


# ----------------------------------------------------------------------------------------------
# FP8 custom ops: y = x @ w with float8 inputs and static scales (SPEC section 4)
# ----------------------------------------------------------------------------------------------

# FP8 SECTION (model work)


# ----------------------------------------------------------------------------------------------
# Orthogonalization: Polar Express and Gram Newton-Schulz (SPEC section 5)
# ----------------------------------------------------------------------------------------------

# ORTHOGONALIZATION SECTION (optimizer work)


# ----------------------------------------------------------------------------------------------
# Optimizer: one fused NorMuon + Adam step that owns all communication (SPEC section 5)
# ----------------------------------------------------------------------------------------------

# OPTIMIZER SECTION (optimizer work)


# ----------------------------------------------------------------------------------------------
# Model (SPEC section 3)
# ----------------------------------------------------------------------------------------------

# MODEL SECTION (model work)


# ----------------------------------------------------------------------------------------------
# Shard files: 256 x int32 header + uint16 GPT-2 token ids (SPEC section 2)
# ----------------------------------------------------------------------------------------------

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
SHARD_HEADER_INTS = 256
SHARD_HEADER_BYTES = SHARD_HEADER_INTS * 4
BOS_ID = 50256  # <|endoftext|> starts every document


class ShardError(ValueError):
    """A shard file that is not what the format promises; the message names the file."""


def write_shard(path: str, tokens) -> None:
    """Write tokens (any int sequence < 2**16) atomically: a temporary file renamed into place."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError(f"{path}: token ids must fit in uint16 (got range {tokens.min()}..{tokens.max()})")
    header = np.zeros(SHARD_HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = SHARD_MAGIC, SHARD_VERSION, tokens.size
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())
    os.replace(tmp, path)


def read_shard_header(path: str) -> int:
    """Validate a shard's header against its size; return its token count."""
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise ShardError(f"{path}: cannot read shard ({e.strerror})") from None
    if size < SHARD_HEADER_BYTES:
        what = "empty file" if size == 0 else f"{size} bytes, shorter than the {SHARD_HEADER_BYTES}-byte header"
        raise ShardError(f"{path}: not a token shard ({what}); re-create or re-download it")
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(SHARD_HEADER_BYTES), dtype="<i4")
    if header[0] != SHARD_MAGIC:
        raise ShardError(f"{path}: bad magic {header[0]} (expected {SHARD_MAGIC}); not a token shard")
    if header[1] != SHARD_VERSION:
        raise ShardError(f"{path}: unsupported shard version {header[1]} (expected {SHARD_VERSION})")
    num_tokens = int(header[2])
    if num_tokens <= 0 or size != SHARD_HEADER_BYTES + 2 * num_tokens:
        raise ShardError(f"{path}: header says {num_tokens} tokens ({SHARD_HEADER_BYTES + 2 * max(num_tokens, 0)} bytes)"
                         f" but the file has {size} bytes; truncated or corrupt, re-create or re-download it")
    return num_tokens


def read_shard(path: str) -> torch.Tensor:
    """Load a whole shard as a uint16 tensor (validated first)."""
    num_tokens = read_shard_header(path)
    with open(path, "rb") as f:
        f.seek(SHARD_HEADER_BYTES)
        data = np.fromfile(f, dtype="<u2", count=num_tokens)
    return torch.from_numpy(data.astype(np.uint16, copy=False))


def find_shards(pattern: str, what: str) -> list[str]:
    """Sorted shard paths for a glob, or a one-line error that says how to make them."""
    files = sorted(glob.glob(pattern))
    if not files:
        hint = ("python data/cached_fineweb10B.py 9" if "fineweb" in pattern
                else "python data/tokenize_text.py --help")
        raise SystemExit(f"error: no {what} shards match {pattern!r}; create them with `{hint}`"
                         f" or point --{what}_files at existing shards")
    return files


# GPT-2 BPE, built offline from the rank file shipped in data/ (same ranks as tiktoken's "gpt2").
GPT2_TIKTOKEN_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gpt2.tiktoken")
GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def gpt2_encoding(rank_file: str | None = GPT2_TIKTOKEN_FILE):
    """The GPT-2 tokenizer. With a rank file (default: the shipped copy, sha256-checked) no network is
    touched; rank_file=None asks tiktoken for its own "gpt2" encoding (which may download)."""
    import tiktoken
    if rank_file is None:
        return tiktoken.get_encoding("gpt2")
    import hashlib
    try:
        with open(rank_file, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        raise SystemExit(f"error: cannot read GPT-2 rank file {rank_file} ({e.strerror})") from None
    if digest != GPT2_TIKTOKEN_SHA256:
        raise SystemExit(f"error: {rank_file} has sha256 {digest}, not the GPT-2 ranks ({GPT2_TIKTOKEN_SHA256})")
    from tiktoken.load import load_tiktoken_bpe
    return tiktoken.Encoding("gpt2", pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=load_tiktoken_bpe(rank_file),
                             special_tokens={"<|endoftext|>": BOS_ID}, explicit_n_vocab=50257)


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(args)


if __name__ == "__main__":
    main()
