"""Download pre-tokenized FineWeb shards (GPT-2 tokens) from the Hugging Face dataset kjj0/fineweb10B-gpt2.

    python data/cached_fineweb10B.py 9     # val shard + the first 9 train shards (~1.9 GB), into data/fineweb10B/

Files already present with a valid header and size are skipped; every downloaded file is checked the
same way. With no network it fails within seconds instead of retrying for minutes.
"""
from __future__ import annotations

import argparse
import os
import sys

# Fail fast without a network: short connection timeouts, set before huggingface_hub is imported.
os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from train_gpt import ShardError, read_shard_header  # noqa: E402

REPO_ID = "kjj0/fineweb10B-gpt2"
NUM_TRAIN_SHARDS = 103
DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fineweb10B")


def shard_names(num_train: int) -> list[str]:
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, num_train + 1)]


def is_complete(path: str) -> bool:
    try:
        read_shard_header(path)
        return True
    except ShardError:
        return False


def check_hub_reachable(timeout: float = 5.0) -> None:
    """One TCP connection to the hub endpoint, so that no network means a prompt, clear error rather than
    huggingface_hub's own retries with back-off (half a minute per file)."""
    import socket
    from urllib.parse import urlparse
    from huggingface_hub import constants
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as e:
        raise SystemExit(f"error: cannot reach the Hugging Face hub at {constants.ENDPOINT} ({e}); "
                         "check the network (or set HF_ENDPOINT to a mirror) and retry")


def download_file(filename: str, local_dir: str) -> str:
    """Fetch one file of the dataset repo into local_dir (huggingface_hub shows a progress bar)."""
    from huggingface_hub import hf_hub_download
    return hf_hub_download(repo_id=REPO_ID, filename=filename, repo_type="dataset", local_dir=local_dir)


def fetch(num_train: int, local_dir: str = DEFAULT_DIR) -> list[str]:
    os.makedirs(local_dir, exist_ok=True)
    names = shard_names(num_train)
    if not all(is_complete(os.path.join(local_dir, name)) for name in names):
        check_hub_reachable()
    paths = []
    for name in names:
        path = os.path.join(local_dir, name)
        if is_complete(path):
            print(f"{path}: present, skipped")
        else:
            if os.path.exists(path):
                os.remove(path)  # a partial or corrupt earlier download
            try:
                download_file(name, local_dir)
            except Exception as e:  # network errors come in many types; the message is what matters
                reason = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise SystemExit(f"error: could not download {name} from the Hugging Face dataset {REPO_ID}"
                                 f" ({type(e).__name__}: {reason}); check the network (or HF_ENDPOINT) and retry")
            try:
                read_shard_header(path)
            except ShardError as e:
                raise SystemExit(f"error: downloaded file is bad: {e}")
            print(f"{path}: downloaded")
        paths.append(path)
    return paths


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("num_train", nargs="?", type=int, default=NUM_TRAIN_SHARDS,
                   help=f"number of train shards (1..{NUM_TRAIN_SHARDS}, ~100M tokens each)")
    p.add_argument("--local_dir", default=DEFAULT_DIR)
    a = p.parse_args(argv)
    if not 0 <= a.num_train <= NUM_TRAIN_SHARDS:
        p.error(f"num_train must be between 0 and {NUM_TRAIN_SHARDS}, got {a.num_train}")
    fetch(a.num_train, a.local_dir)


if __name__ == "__main__":
    main()
