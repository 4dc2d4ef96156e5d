"""Check and summarize record logs; optionally plot validation loss against training time.

    python records/summarize.py records/<record>/*.txt                 # per-run table + statistics
    python records/summarize.py logs/*.txt --target 3.28 --plot out.png  # and a plot

A log counts only if it embeds both source files and reached its last step with a final validation.
Prints, per run, the final validation loss and training time; then the mean and (sample) standard
deviation of the final losses, the one-sided t-test p-value for "mean < target" (a record needs
p < 0.01) and the mean training time. Also the tests the benchmarks' ablation tables use (Welch's
t-test, the paired t-test, Holm's adjustment for many rows).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import dataclass

SOURCE_MARKERS = ("==== train_gpt.py ====", "==== triton_kernels.py ====")
VAL_LINE = re.compile(r"^step:(\d+)/(\d+) val_loss:([0-9.eE+-]+|nan|inf) train_time:(\d+(?:\.\d+)?)ms", re.M)


class LogError(ValueError):
    pass


@dataclass
class Run:
    path: str
    val_curve: list[tuple[float, float]]  # (train_time_ms, val_loss)
    final_loss: float
    train_time_ms: float


def parse_log(path: str) -> Run:
    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        raise LogError(f"{path}: cannot read ({e})") from None
    missing = [m.strip("= ") for m in SOURCE_MARKERS if m not in text]
    if missing:
        raise LogError(f"{path}: does not embed the source of {', '.join(missing)}; not a complete record log")
    vals = [(int(s), int(t), float(v), float(ms)) for s, t, v, ms in VAL_LINE.findall(text)]
    if not vals:
        raise LogError(f"{path}: no validation lines (step:N/T val_loss:X train_time:Ms)")
    step, total, loss, ms = vals[-1]
    if step != total:
        raise LogError(f"{path}: stopped early (last validation at step {step} of {total})")
    if not math.isfinite(loss):
        raise LogError(f"{path}: final validation loss is {loss}")
    return Run(path, [(v[3], v[2]) for v in vals], loss, ms)


def student_t_sf_lower(t: float, dof: int) -> float:
    """P(T <= t) for Student's t with dof degrees of freedom."""
    from scipy import stats  # a tool extra (requirements-dev.txt), not a runtime requirement
    return float(stats.t.cdf(t, dof))


def welch_t_test(a: list[float], b: list[float]) -> tuple[float, float]:
    """Welch's t statistic and two-sided p-value for "mean(a) == mean(b)" (unequal variances), for
    comparing two sets of seeds (tests/benchmarks/token_efficiency.py's ablations)."""
    na, nb = len(a), len(b)
    ma, mb = sum(a) / na, sum(b) / nb
    va = sum((x - ma) ** 2 for x in a) / (na - 1)
    vb = sum((x - mb) ** 2 for x in b) / (nb - 1)
    se2 = va / na + vb / nb
    if se2 == 0:
        return (0.0, 1.0) if ma == mb else (math.copysign(math.inf, ma - mb), 0.0)
    t = (ma - mb) / math.sqrt(se2)
    dof = se2 ** 2 / ((va / na) ** 2 / (na - 1) + (vb / nb) ** 2 / (nb - 1))
    return t, 2 * student_t_sf_lower(-abs(t), dof)


def paired_t_test(a: list[float], b: list[float]) -> tuple[float, float]:
    """t statistic and two-sided p-value of the paired t-test for "mean(a[i] - b[i]) == 0" (a[i] and b[i]
    one pair, e.g. two runs of the same seed: what the seed moves cancels in the difference). NaN for
    fewer than two pairs; differences without spread give p 1 (all zero) or 0."""
    if len(a) != len(b):
        raise ValueError(f"paired_t_test: {len(a)} values against {len(b)}; pairs need the same count")
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    if n < 2 or any(math.isnan(x) for x in d):
        return math.nan, math.nan
    m = sum(d) / n
    var = sum((x - m) ** 2 for x in d) / (n - 1)
    if var == 0:
        return (0.0, 1.0) if m == 0 else (math.copysign(math.inf, m), 0.0)
    t = m / math.sqrt(var / n)
    return t, 2 * student_t_sf_lower(-abs(t), n - 1)


def holm(pvalues: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values, in the given order: the k-th smallest of m is multiplied by
    m - k + 1, made non-decreasing along that order and capped at 1, so that "adjusted p < alpha" keeps
    the chance of any false positive among the m tests below alpha. NaN entries are not tests: they stay
    NaN and do not count in m."""
    tests = sorted((p, i) for i, p in enumerate(pvalues) if not math.isnan(p))
    m = len(tests)
    adjusted = [math.nan] * len(pvalues)
    running = 0.0
    for k, (p, i) in enumerate(tests):
        running = max(running, min(1.0, (m - k) * p))
        adjusted[i] = running
    return adjusted


def summarize(runs: list[Run], target: float) -> dict:
    losses = [r.final_loss for r in runs]
    n = len(losses)
    mean = sum(losses) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in losses) / (n - 1)) if n > 1 else float("nan")
    if n > 1 and std > 0:
        p = student_t_sf_lower((mean - target) / (std / math.sqrt(n)), n - 1)
    else:
        p = float("nan")
    return {"n": n, "mean": mean, "std": std, "p": p, "mean_time_ms": sum(r.train_time_ms for r in runs) / n}


def plot(groups: dict[str, list[Run]], out: str, target: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, runs) in enumerate(groups.items()):
        for j, run in enumerate(runs):
            xs = [ms / 1000 for ms, _ in run.val_curve]
            ys = [loss for _, loss in run.val_curve]
            ax.plot(xs, ys, color=colors[i % len(colors)], alpha=0.8, marker=".",
                    label=name if j == 0 else None)
    ax.axhline(target, color="gray", linestyle="--", label=f"target {target}")
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("validation loss")
    ax.legend()
    ax.grid(alpha=0.3)
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    os.replace(tmp, out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", help="log files, or record folders (every .txt inside)")
    p.add_argument("--target", type=float, default=3.28, help="validation loss the mean must beat")
    p.add_argument("--plot", metavar="OUT.png", help="plot validation loss against training time")
    a = p.parse_args(argv)

    groups: dict[str, list[Run]] = {}
    for item in a.logs:
        if os.path.isdir(item):
            paths = sorted(os.path.join(item, f) for f in os.listdir(item) if f.endswith(".txt"))
            name = os.path.basename(os.path.normpath(item))
        else:
            paths, name = [item], "runs"
        for path in paths:
            try:
                groups.setdefault(name, []).append(parse_log(path))
            except LogError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
    runs = [r for rs in groups.values() for r in rs]
    if not runs:
        print("error: no logs given (record folders hold .txt logs)", file=sys.stderr)
        return 2
    width = max(len(r.path) for r in runs)
    print(f"{'log':<{width}}  val_loss  train_time")
    for r in runs:
        print(f"{r.path:<{width}}  {r.final_loss:8.4f}  {r.train_time_ms / 1000:9.2f}s")
    s = summarize(runs, a.target)
    print(f"runs: {s['n']}")
    print(f"mean val_loss: {s['mean']:.4f}")
    print(f"std val_loss: {s['std']:.4f}")
    print(f"p-value (one-sided t-test, mean < {a.target}): {s['p']:.4g}")
    print(f"mean train_time: {s['mean_time_ms'] / 1000:.2f}s")
    if a.plot:
        plot(groups, a.plot, a.target)
        print(f"plot: {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
