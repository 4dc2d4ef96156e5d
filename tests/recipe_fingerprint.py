"""The `test` preset's training, reduced to numbers that any change in behaviour moves.

    python tests/recipe_fingerprint.py > fingerprint.json

Trains the `test` preset for 9 scheduled steps and 1 extension step (one process, fp32, no compile)
and prints JSON: every step's training loss (float.hex, bit-exact), the final validation loss, and a
SHA-256 of every parameter of the final checkpoint. tests/test_recipe_fingerprint.py runs it under
pinned CPU settings (one thread, AVX2 kernels, MKL's AVX2 reproducibility mode) and compares it with
the stored tests/data/recipe_fingerprint.json, taken from the code before a restructuring of the
recipe's settings into stage and layer rows (a refactor that changes nothing keeps every bit), and
stored again when the CPU head was fused with its loss, a change of summation order: every training
loss kept its bits, the final parameters moved by rounding. Store it again only for such a change,
saying so in the commit.
"""
import contextlib
import hashlib
import json
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import train_gpt as tg  # noqa: E402

FLAGS = ["--preset", "test", "--num_iterations", "9", "--extension_iterations", "1", "--cpu_dtype", "fp32",
         "--compile", "false", "--val_loss_every", "0", "--save_every", "1000", "--run_id", "fingerprint"]


def fingerprint() -> dict:
    losses = []
    forward_backward = tg.forward_backward

    def recording_forward_backward(*args, **kwargs):
        loss = forward_backward(*args, **kwargs)
        losses.append(float(loss[0].detach().double()))  # the objective
        return loss

    tg.forward_backward = recording_forward_backward
    with tempfile.TemporaryDirectory() as tmp:
        args = tg.parse_args(FLAGS + ["--log_dir", os.path.join(tmp, "logs"),
                                      "--checkpoint_dir", os.path.join(tmp, "ckpt")])
        with contextlib.redirect_stdout(sys.stderr):  # the progress lines; stdout carries the JSON only
            val_loss = tg.train(args, tg.setup_distributed(force_cpu=True))
        (step_dir,) = os.listdir(os.path.join(tmp, "ckpt", "fingerprint"))
        state = torch.load(os.path.join(tmp, "ckpt", "fingerprint", step_dir, "model.pt"),
                           map_location="cpu", weights_only=False)["model"]
    params = {name: hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
              for name, t in sorted(state.items()) if t.is_floating_point()}
    return {"train_losses": [x.hex() for x in losses], "val_loss": float(val_loss).hex(), "params": params,
            "checkpoint": step_dir, "torch": torch.__version__}


if __name__ == "__main__":
    json.dump(fingerprint(), sys.stdout, indent=1, sort_keys=True)
    print()
