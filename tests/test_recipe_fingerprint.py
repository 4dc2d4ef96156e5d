"""Restructuring the recipe's settings changes no number: the `test` preset's training losses and
final parameters are bitwise those stored from the code before (tests/recipe_fingerprint.py)."""
import json
import math
import os
import subprocess
import sys

import pytest

from train_gpt import cpu_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORED = os.path.join(ROOT, "tests", "data", "recipe_fingerprint.json")
# One thread and AVX2 kernels everywhere (oneDNN, ATen, MKL's conditional numerical reproducibility):
# the same bits on any x86 machine with AVX2, whatever its own vector units.
PINNED = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "ONEDNN_MAX_CPU_ISA": "AVX2",
          "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "OPENBLAS_CORETYPE": "Haswell"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fingerprint():
    env = {**os.environ, **PINNED}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "recipe_fingerprint.py")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout)


def test_training_matches_the_stored_fingerprint(fingerprint):
    with open(STORED, encoding="utf-8") as f:
        stored = json.load(f)
    version = fingerprint.pop("torch")
    if version not in stored["runs"]:
        pytest.skip(f"no fingerprint stored for torch {version} (stored: {', '.join(stored['runs'])})")
    want = stored["runs"][version]
    assert fingerprint["checkpoint"] == want["checkpoint"]
    assert len(fingerprint["train_losses"]) == len(want["train_losses"]) == 10
    if cpu_model() == stored["cpu"] or fingerprint == want:
        assert fingerprint["train_losses"] == want["train_losses"]
        assert fingerprint["val_loss"] == want["val_loss"]
        assert fingerprint["params"] == want["params"]
    else:  # another CPU model: same kernels, but a library may still pick another code path
        got = [float.fromhex(x) for x in fingerprint["train_losses"]]
        ref = [float.fromhex(x) for x in want["train_losses"]]
        assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(got, ref)), (got, ref)
        assert set(fingerprint["params"]) == set(want["params"])


def test_a_changed_number_changes_the_fingerprint(fingerprint, tmp_path):
    """The comparison can fail: one changed hyperparameter (Adam's lr x 1.0001) moves the losses."""
    env = {**os.environ, **PINNED}
    code = ("import sys; sys.argv = sys.argv[:1]; sys.path.insert(0, 'tests'); import recipe_fingerprint as f; "
            "f.FLAGS = f.FLAGS + ['--adam_lr', repr(0.008 * 1.0001)]; import json; "
            "print(json.dumps(f.fingerprint()))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    changed = json.loads(r.stdout)
    assert changed["train_losses"][:2] == fingerprint["train_losses"][:2]  # Adam first steps at step 1
    assert changed["train_losses"] != fingerprint["train_losses"]
    assert changed["params"] != fingerprint["params"]
