"""run.sh's interpreter rules, without network.

- PYTHON=... is used as it is: an interpreter that lacks a package (or is too old) stops run.sh with one
  line naming what is missing and the fix, exit status 1, and nothing is installed anywhere;
- PYTHON=... with everything installed launches (--dry-run prints the command) with no install;
- without PYTHON, run.sh makes its own .venv beside itself, installs only when the requirements are not
  met, and says so (run in a copy of run.sh, with requirements files that need no download).
"""
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_SH = os.path.join(REPO, "run.sh")
# Belt and braces: even a run.sh that wrongly called pip could not reach an index from these tests.
NO_NETWORK = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull}


def run_sh(*args, python=None, cwd_script=RUN_SH, timeout=120, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "NPROC")}
    env.update(NO_NETWORK, CUDA_VISIBLE_DEVICES="")
    env.update(env_extra or {})
    if python is not None:
        env["PYTHON"] = python
    return subprocess.run(["bash", cwd_script, *args], capture_output=True, text=True, timeout=timeout, env=env)


def files_under(path):
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


@pytest.fixture
def bare_python(tmp_path):
    """A fresh venv with no packages at all (not even pip)."""
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    return venv


def test_python_without_torch_stops_with_one_line_and_installs_nothing(bare_python):
    py = str(bare_python / "bin" / "python")
    before = files_under(bare_python)
    had_venv = os.path.exists(os.path.join(REPO, ".venv"))
    for args, also_missing in ((["--dry-run"], []), (["test"], ["pytest", "scipy", "matplotlib"]),
                               (["bench", "--dry-run"], [])):
        r = run_sh(*args, python=py)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert r.stdout == ""
        lines = r.stderr.splitlines()
        assert len(lines) == 1, r.stderr
        assert lines[0].startswith(f"run.sh: PYTHON={py} lacks torch>=2.11, triton>=3.6, numpy, tiktoken")
        for name in also_missing:
            assert name in lines[0]
        assert "unset PYTHON to use .venv" in lines[0]
    assert files_under(bare_python) == before, "run.sh installed into the PYTHON it was given"
    assert os.path.exists(os.path.join(REPO, ".venv")) == had_venv, "run.sh made .venv although PYTHON was set"


def test_python_too_old_or_missing_stops_with_one_line(tmp_path):
    fake = tmp_path / "python3.9"
    fake.write_text("#!/bin/sh\necho 3.9\nexit 1\n")  # answers the version probe like a Python 3.9
    fake.chmod(0o755)
    r = run_sh("--dry-run", python=str(fake))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [f"run.sh: PYTHON={fake} is Python 3.9, not >= 3.10; "
                                     "point PYTHON at a newer one, or unset PYTHON to use .venv"]
    r = run_sh("--dry-run", python=str(tmp_path / "no-such-python"))
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1 and "is not an executable" in r.stderr


def test_python_with_everything_dry_run_launches_without_install():
    r = run_sh("--dry-run", "--num_iterations", "5", python=sys.executable)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", "nothing to install, nothing to say"
    launch = [line for line in r.stdout.splitlines() if line.startswith("launch: ")]
    assert launch == [f"launch: {sys.executable} -m torch.distributed.run --standalone --nproc_per_node=2 "
                      "train_gpt.py --preset demo --num_iterations 5"]


def test_test_oldest_refuses_python(bare_python):
    r = run_sh("test-oldest", python=str(bare_python / "bin" / "python"))
    assert r.returncode == 1
    assert r.stderr.splitlines() == ["run.sh: test-oldest makes and uses its own .venv-oldest (torch 2.11); unset PYTHON"]


@pytest.mark.slow
def test_default_makes_own_venv_and_installs_only_when_needed(tmp_path):
    """A copy of run.sh whose requirements need nothing from an index: the venv is made once, beside
    run.sh; requirements already met install nothing; unmet ones go to pip (visibly), and a failed pip
    stops run.sh with exit 1 (with no index reachable, a package that is not installed cannot be)."""
    shutil.copy(RUN_SH, tmp_path / "run.sh")
    (tmp_path / "requirements.txt").write_text("# nothing to install\n")
    script = str(tmp_path / "run.sh")

    r = run_sh("--dry-run", cwd_script=script)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / ".venv" / "bin" / "python").exists()
    assert r.stderr.startswith("run.sh: creating .venv (python3 -m venv, ")
    assert "installing" not in r.stderr
    assert "launch: .venv/bin/python -m torch.distributed.run" in r.stdout

    r = run_sh("--dry-run", cwd_script=script)  # second run: nothing made, nothing installed, nothing said
    assert r.returncode == 0 and r.stderr == "", r.stderr

    (tmp_path / "requirements.txt").write_text("run-sh-test-not-a-package==0.0.1\n")
    r = run_sh("--dry-run", cwd_script=script)
    assert r.returncode == 1
    assert "run.sh: installing requirements.txt into .venv (pip's own progress follows)" in r.stderr
    assert r.stderr.splitlines()[-1] == "run.sh: pip install -r requirements.txt into .venv failed (see above)"
    assert "launch:" not in r.stdout


@pytest.mark.slow
def test_a_machine_with_an_nvidia_gpu_gets_the_gpu_checked_stack(tmp_path):
    """nvidia-smi listing a GPU makes run.sh install requirements-gpu.txt (the stack of the recorded GPU
    figures) instead of requirements.txt, and `test` the GPU stack plus the test tools
    (requirements-oldest.txt); without a GPU (or with CUDA_VISIBLE_DEVICES empty) the newest pins. Here
    only the file run.sh picks needs nothing from an index: any other choice fails at pip."""
    shutil.copy(RUN_SH, tmp_path / "run.sh")
    absent = "run-sh-test-not-a-package==0.0.1\n"
    for name in ("requirements.txt", "requirements-dev.txt", "requirements-oldest.txt"):
        (tmp_path / name).write_text(absent)
    (tmp_path / "requirements-gpu.txt").write_text("# nothing to install\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    fake.chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    script = str(tmp_path / "run.sh")

    gpu = dict(PATH=path, CUDA_VISIBLE_DEVICES="0")
    r = run_sh("--dry-run", cwd_script=script, env_extra=gpu)
    assert r.returncode == 0, r.stderr
    assert "pins: requirements-gpu.txt (gpu stack)" in r.stdout.splitlines()

    r = run_sh("test", "--version", cwd_script=script, env_extra=gpu)  # the test tools are not met here
    assert r.returncode == 1
    assert "run.sh: installing requirements-oldest.txt into .venv" in r.stderr

    for no_gpu in (dict(PATH=path, CUDA_VISIBLE_DEVICES=""), {}):  # GPUs hidden; no nvidia-smi at all
        r = run_sh("--dry-run", cwd_script=script, env_extra=no_gpu)
        assert r.returncode == 1
        assert "run.sh: installing requirements.txt into .venv" in r.stderr, r.stderr
