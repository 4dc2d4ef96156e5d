"""The benchmark corpus that a token budget does not repeat: the Python source of SymPy 1.14.0.

Token-efficiency figures on tiny Shakespeare (302K train tokens) measure memorisation as much as
learning once the budget passes one epoch. This corpus is built offline, reproducibly, from a pinned
wheel on the package index: its 1,453 non-empty .py files (code, docstrings, doctests; 26 MB), each cut
at blank lines into documents of at most 2,000 characters (split()): 12,488,424 train tokens in 14,260
documents and 228,763 held-out tokens in 290. Files are ordered by the SHA-256 of their path (a fixed
shuffle, so that a budget of any size samples every subpackage), and the last 2% of that order is the
held-out split (whole files: no validation text was ever seen in training).

    python data/sympy_source.py                     # pip-downloads the wheel (6 MB) into data/sympy/
    python data/sympy_source.py --wheel PATH.whl    # a wheel already at hand (checked against the pin)

Writes data/sympy/sympy_train_000001.bin ... and data/sympy/sympy_val_000000.bin (data/README.md;
its use: records/README.md "Token efficiency").
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import os
import subprocess
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from tokenize_text import GPT2_TIKTOKEN_FILE, pack_documents, split_documents, tokenize, write_shards  # noqa: E402

PACKAGE = "sympy==1.14.0"
WHEEL_SHA256 = "e091cc3e99d2141a0ba2847328f5479b05d94a6635cb96148ccb3f34671bd8f5"
VAL_FRACTION = 0.02
DOC_CHARS = 2_000


def fetch_wheel(out_dir: str) -> str:
    """The pinned wheel from the package index (pip of this interpreter, no dependencies)."""
    found = glob.glob(os.path.join(out_dir, "sympy-1.14.0-*.whl"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", out_dir, PACKAGE]
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"error: `pip download {PACKAGE}` failed; download the wheel elsewhere and pass --wheel PATH")
    return glob.glob(os.path.join(out_dir, "sympy-1.14.0-*.whl"))[0]


def source_documents(wheel: str, sha256: str) -> list[tuple[str, str]]:
    """(path, text) of every .py file in the wheel, in the fixed order (SHA-256 of the path)."""
    try:
        data = open(wheel, "rb").read()
    except OSError as e:
        raise SystemExit(f"error: --wheel {wheel}: cannot read ({e.strerror})") from None
    if sha256 and hashlib.sha256(data).hexdigest() != sha256:
        raise SystemExit(f"error: --wheel {wheel} is not the pinned {PACKAGE} wheel (SHA-256 differs); "
                         "the corpus would not be the documented one")
    try:
        with zipfile.ZipFile(wheel) as z:
            docs = [(name, z.read(name).decode("utf-8")) for name in z.namelist() if name.endswith(".py")]
    except zipfile.BadZipFile:
        raise SystemExit(f"error: --wheel {wheel} is not a wheel (zip) file") from None
    return sorted(docs, key=lambda d: hashlib.sha256(d[0].encode()).hexdigest())


def split(docs: list[tuple[str, str]], val_fraction: float) -> tuple[list[str], list[str]]:
    """Train and held-out documents: the files of the last val_fraction of the fixed order are held out.
    Each file is cut at blank lines into documents of up to DOC_CHARS characters (about 1,000 tokens):
    the training loader keeps only a document's first max_doc_len tokens (512 / 1024 in the demo), so
    whole files would be seen only by their heads, over and over."""
    files = [text for _, text in docs if text.strip()]
    cut = len(files) - max(1, round(val_fraction * len(files)))
    pieces = [pack_documents(split_documents(text, "\n\n"), "\n\n", DOC_CHARS) for text in files]
    return [d for p in pieces[:cut] for d in p], [d for p in pieces[cut:] for d in p]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default=os.path.join(HERE, "sympy"))
    p.add_argument("--wheel", default="", help=f"the {PACKAGE} wheel (default: pip-download it into --out_dir)")
    p.add_argument("--sha256", default=WHEEL_SHA256, help="expected SHA-256 of the wheel ('' skips the check)")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1) - 1))
    a = p.parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    train, val = split(source_documents(a.wheel or fetch_wheel(a.out_dir), a.sha256), VAL_FRACTION)
    for name, docs in (("train", train), ("val", val)):
        tokens = tokenize(docs, a.workers, GPT2_TIKTOKEN_FILE)
        for path in write_shards(tokens, a.out_dir, "sympy", name, 100_000_000):
            print(f"{path}: {len(tokens):,} tokens, {len(docs):,} documents")


if __name__ == "__main__":
    main()
