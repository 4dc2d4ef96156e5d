"""records/summarize.py on fabricated logs with known statistics (and on the committed demo record)."""
import glob
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "records", "summarize.py")


def fake_log(path, final_loss, final_ms, total=100, sources=True, stop_at=None):
    lines = []
    if sources:
        lines += ["==== train_gpt.py ====", "print('hi')", "==== triton_kernels.py ====", "pass"]
    lines += ["==== training ===="]
    last = total if stop_at is None else stop_at
    for step in range(0, last + 1, 50):
        ms = final_ms * step / total
        lines.append(f"step:{step}/{total} train_time:{ms:.0f}ms step_avg:{final_ms / total:.2f}ms")
        loss = final_loss + (total - step) / total
        lines.append(f"step:{step}/{total} val_loss:{loss:.4f} train_time:{ms:.0f}ms")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def run_tool(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=120)


def parse_output(out):
    values = {}
    for line in out.splitlines():
        if ":" in line and not line.startswith(("log", "/")):
            key, _, value = line.rpartition(":")
            values[key.strip()] = value.strip()
    return values


def test_statistics_match_scipy(tmp_path):
    losses = [3.2712, 3.2765, 3.2741, 3.2790, 3.2733, 3.2758]
    times = [74_100, 73_900, 74_400, 74_000, 74_250, 73_800]
    logs = [fake_log(tmp_path / f"r{i}.txt", l, t) for i, (l, t) in enumerate(zip(losses, times))]
    r = run_tool(*logs)
    assert r.returncode == 0, r.stderr
    v = parse_output(r.stdout)
    expected = stats.ttest_1samp(losses, 3.28, alternative="less")
    assert float(v["mean val_loss"]) == pytest.approx(np.mean(losses), abs=1e-4)
    assert float(v["std val_loss"]) == pytest.approx(np.std(losses, ddof=1), abs=1e-4)
    assert float(v["p-value (one-sided t-test, mean < 3.28)"]) == pytest.approx(expected.pvalue, rel=1e-3)
    assert v["mean train_time"] == f"{np.mean(times) / 1000:.2f}s"
    assert v["runs"] == "6"
    for log, loss in zip(logs, losses):
        assert any(line.startswith(log) and f"{loss:.4f}" in line for line in r.stdout.splitlines())


@pytest.mark.parametrize("a,b", [
    ([4.51, 4.53, 4.50], [4.60, 4.64, 4.58, 4.61]),   # clearly apart
    ([4.51, 4.53, 4.50], [4.52, 4.49]),               # within noise
])
def test_welch_t_test_matches_scipy(a, b):
    t, p = _summarize().welch_t_test(a, b)
    ref = stats.ttest_ind(a, b, equal_var=False)
    assert t == pytest.approx(ref.statistic, rel=1e-9) and p == pytest.approx(ref.pvalue, rel=1e-6)


def test_welch_t_test_one_side_without_spread_by_hand():
    """[1, 2] against [2.5, 2.5, 2.5]: the second side adds no variance, so t = (1.5 - 2.5) / sqrt(0.5 / 2)
    = -2 with Welch's df = n_a - 1 = 1, Student's t with one degree of freedom is the Cauchy
    distribution: two-sided p = 1 - (2 / pi) atan(2). (scipy warns of cancellation on constant data.)"""
    t, p = _summarize().welch_t_test([1.0, 2.0], [2.5, 2.5, 2.5])
    assert t == pytest.approx(-2.0, rel=1e-12) and p == pytest.approx(1 - 2 / math.pi * math.atan(2.0), rel=1e-9)


def _summarize():
    sys.path.insert(0, os.path.join(ROOT, "records"))
    import summarize
    return summarize


def test_paired_t_test_by_hand():
    """Closed forms of Student's t: with 1 degree of freedom it is Cauchy, P(T <= t) = 1/2 + atan(t)/pi;
    with 2, P(T <= t) = 1/2 + t / (2 sqrt(2 + t^2))."""
    s = _summarize()
    t, p = s.paired_t_test([3.0, 5.0], [2.0, 2.0])      # differences 1, 3: mean 2, sd sqrt(2), se 1
    assert t == pytest.approx(2.0, rel=1e-12)
    assert p == pytest.approx(1 - 2 * math.atan(2.0) / math.pi, rel=1e-9)   # 0.2952
    t, p = s.paired_t_test([1.5, 2.5, 7.5], [0.5, 0.5, 1.5])   # differences 1, 2, 6: mean 3, var 7
    want_t = 3 / math.sqrt(7 / 3)
    assert t == pytest.approx(want_t, rel=1e-12)
    assert p == pytest.approx(1 - want_t / math.sqrt(2 + want_t ** 2), rel=1e-9)
    assert s.paired_t_test([1.0, 2.0], [2.0, 5.0])[0] == pytest.approx(-2.0)   # the sign follows a - b
    ref = stats.ttest_rel([4.51, 4.53, 4.50, 4.56], [4.49, 4.50, 4.50, 4.52])
    assert s.paired_t_test([4.51, 4.53, 4.50, 4.56], [4.49, 4.50, 4.50, 4.52]) == pytest.approx(
        (ref.statistic, ref.pvalue), rel=1e-6)
    assert all(math.isnan(x) for x in s.paired_t_test([1.0], [2.0]))          # one pair: no test
    assert s.paired_t_test([1.0, 2.0], [0.5, 1.5]) == (math.inf, 0.0)          # the same difference twice
    assert s.paired_t_test([1.0, 2.0], [1.0, 2.0]) == (0.0, 1.0)
    with pytest.raises(ValueError):
        s.paired_t_test([1.0, 2.0], [1.0])


def _step_down_rejections(pvalues, alpha):
    """Holm's procedure as first stated: test the smallest p against alpha / m, the next against
    alpha / (m - 1), ..., and stop at the first that fails; the earlier ones are rejected."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    rejected = set()
    for k, i in enumerate(order):
        if pvalues[i] > alpha / (len(pvalues) - k):
            break
        rejected.add(i)
    return rejected


def test_holm_textbook_example_and_step_down():
    s = _summarize()
    # four tests: at alpha 0.05 the step-down rejects 0.005 (< 0.0125) and 0.01 (< 0.0167), not 0.03 (> 0.025)
    adjusted = s.holm([0.01, 0.04, 0.03, 0.005])
    assert adjusted == pytest.approx([0.03, 0.06, 0.06, 0.02], rel=1e-12)
    assert {i for i, a in enumerate(adjusted) if a <= 0.05} == _step_down_rejections([0.01, 0.04, 0.03, 0.005], 0.05)
    rng = np.random.default_rng(0)
    for _ in range(50):
        p = list(rng.uniform(0, 0.2, size=int(rng.integers(1, 12))) ** 2)
        adjusted = s.holm(p)
        assert all(a >= q for a, q in zip(adjusted, p)) and max(adjusted) <= 1.0
        for alpha in [*p, *(x * 1.0000001 for x in p), 0.01, 0.05, 0.1]:  # an adjusted p is the smallest alpha that rejects
            assert {i for i, a in enumerate(adjusted) if a <= alpha} == _step_down_rejections(p, alpha)
    assert s.holm([0.02, math.nan, 0.01]) == pytest.approx([0.02, math.nan, 0.02], nan_ok=True)  # NaN: not a test
    assert s.holm([0.6, 0.7]) == [1.0, 1.0]


def test_record_folder_and_plot(tmp_path):
    rec = tmp_path / "rec"
    rec.mkdir()
    for i, loss in enumerate([4.5, 4.6, 4.55]):
        fake_log(rec / f"{i}.txt", loss, 60_000)
    out = tmp_path / "plot.png"
    r = run_tool(str(rec), "--target", "5.0", "--plot", str(out))
    assert r.returncode == 0, r.stderr
    expected = stats.ttest_1samp([4.5, 4.6, 4.55], 5.0, alternative="less").pvalue
    assert float(parse_output(r.stdout)["p-value (one-sided t-test, mean < 5.0)"]) == pytest.approx(expected, rel=1e-3)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


@pytest.mark.parametrize("kind,message", [
    ("nosource", "does not embed the source"), ("early", "stopped early (last validation at step 50 of 100)"),
])
def test_refuses_incomplete_logs(tmp_path, kind, message):
    good = fake_log(tmp_path / "good.txt", 3.27, 70_000)
    bad = fake_log(tmp_path / "bad.txt", 3.27, 70_000, sources=kind != "nosource",
                   stop_at=50 if kind == "early" else None)
    r = run_tool(good, bad)
    assert r.returncode == 2
    assert message in r.stderr and "bad.txt" in r.stderr and r.stderr.count("\n") == 1


def test_demo_record_logs():
    """The committed CPU demo record: real logs of the real script parse, and the tool reports the mean
    of the final validation line of each log."""
    folder = os.path.join(ROOT, "records", "cpu_demo_2cores")
    logs = glob.glob(os.path.join(folder, "*.txt"))
    assert logs
    r = run_tool(folder, "--target", "5.0")
    assert r.returncode == 0, r.stderr
    finals = []
    for path in logs:
        last_val = [line for line in open(path) if " val_loss:" in line and line.startswith("step:")][-1]
        finals.append(float(last_val.split("val_loss:")[1].split()[0]))
    out = parse_output(r.stdout)
    assert int(out["runs"]) == len(logs)
    assert float(out["mean val_loss"]) == pytest.approx(sum(finals) / len(finals), abs=1e-4)
