"""The token-efficiency figures the READMEs quote are what `tests/benchmarks/token_efficiency.py --load`
prints for the committed results folders, and the floors saved beside older runs are what the shards give.

records/README.md marks each quoting paragraph or table with the folder(s) it quotes:

    <!-- figures: records/token_efficiency_sympy_500K -->
    ... every loss, delta, p-value, rate (3+ decimals) and token count (5+ digits) in here ...
    <!-- /figures -->

and each of those figures must appear, as printed, in the --load output of one of the named folders; a
figure in a README table row naming an ablation, or in text after <!-- row: LABEL -->, on that ablation's row.
Prose comparing two runs is marked with the pair (<!-- compare: DIR A,B --> ... <!-- /compare -->) and
checked against `--load DIR --compare A,B` and the two JSONs (below). Each results folder's own README lists its runs in a table (| run | lr | ... | best val | at tokens |);
every row is checked against the run's JSON curve."""
import contextlib
import functools
import glob
import io
import json
import os
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "benchmarks"))

import token_efficiency as te  # noqa: E402

# a decimal with 3+ digits after the point (losses, deltas, p-values, rates), or a comma-grouped count
FIGURE = re.compile(r"(?<![\w.,])[+-]?\d+\.\d{3,}(?!\d)|(?<![\w.,])\d{1,3}(?:,\d{3})+(?![\d,])")
REGION = re.compile(r"<!-- figures: (.*?) -->(.*?)<!-- /figures -->", re.S)
# The READMEs' prose that compares two runs of a folder marks each comparison with the pair:
#     <!-- compare: records/token_efficiency_sympy_12M_tune classic_A_s0,classic_B_s0 --> ... <!-- /compare -->
# Each decimal in it (2+ places) must be a number `--load DIR --compare A,B` prints (a setting) or a rounding of
# one (a loss, a difference at an evaluation, a best, last or floor gap), and each count (5+ digits) one it prints.
COMPARE_REGION = re.compile(r"<!-- compare: (\S+) (\S+) -->(.*?)<!-- /compare -->", re.S)
DECIMAL = re.compile(r"(?<![\w.,])\d+\.\d{2,}(?![\dM])")  # not token positions (1.77M)
# how a comparison says A ends against B: "ends 0.027 behind at 2.4805", "ending 0.01 ahead", "ends at **1.4448**, 0.019 behind"
ENDS = re.compile(r"end(?:s|ing)\s+(?:only\s+)?(?:at\s+\**(\d+\.\d{4})\**,\s+)?(\d+\.\d+)\s+(ahead|behind)(?:\s+at\s+\**(\d+\.\d{4}))?")
# results folders: those with a saved run (one whose runs are all still in progress holds only partial/ and logs/)
FOLDERS = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "records", "token_efficiency_*"))
                 if glob.glob(os.path.join(p, "*.json")))


def figures(text: str) -> list[str]:
    """The checked figures of a text; counts below 10,000 (batch sizes, contexts, years) are settings."""
    return [f for f in FIGURE.findall(text) if "." in f or int(f.replace(",", "")) >= 10_000]


@functools.lru_cache(maxsize=None)
def load_output(folder: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        te.report(os.path.join(REPO, folder), None, plot=False)
    return out.getvalue()


def regions() -> list[tuple[list[str], str]]:
    with open(os.path.join(REPO, "records", "README.md"), encoding="utf-8") as f:
        text = f.read()
    return [([s.strip() for s in names.split(",")], body) for names, body in REGION.findall(text)]


# a row of the ablation table --load prints: "bigram hash embedding   3   3.6566 +- 0.0104  +0.0575 ..."
ABLATION_ROW = re.compile(r"^(\S.*?)\s+\d+\s+\d+\.\d{4} \+- ")
# prose about one ablation row is marked with its label; it runs to the next mark or the region's end
ROW_MARK = re.compile(r"<!-- row: (.*?) -->")


def ablation_rows(output: str) -> tuple[dict[str, set[str]], set[str]]:
    """The figures --load prints on each row of its ablation table (by the row's label), and those it
    prints anywhere else (the recipe's seeds and mean, the floors, the ratio)."""
    rows, other, in_table = {}, set(), False
    for line in output.splitlines():
        if line.startswith("switched off / replaced"):
            in_table = True
            continue
        if line.startswith("delta > 0"):
            in_table = False
        m = ABLATION_ROW.match(line) if in_table else None
        if m:
            rows.setdefault(m.group(1), set()).update(figures(line))
        else:
            other.update(figures(line))
    return rows, other


def row_label(first_cell: str, labels) -> str | None:
    """The printed label a README table row names: the longest one its first cell starts with."""
    cell = first_cell.lower()
    named = [label for label in labels if cell.startswith(label.lower())]
    return max(named, key=len) if named else None


@pytest.mark.parametrize("folders,body", regions(), ids=lambda x: "+".join(x) if isinstance(x, list) else "")
def test_quoted_figures_are_what_load_prints(folders, body):
    """Each figure is printed by --load; one in a README table row naming an ablation is printed on that
    row, and one in prose marked <!-- row: LABEL --> on that row or outside the ablation table (the
    recipe's own figures), so a figure of one component quoted for another does not pass."""
    assert all(f in FOLDERS for f in folders), f"{folders}: not a committed token-efficiency folder ({FOLDERS})"
    body = COMPARE_REGION.sub("", body)  # a marked comparison inside is checked against --compare
    quoted = figures(body)
    assert quoted, "a marked region with no figure to check"
    output = "\n".join(load_output(f) for f in folders)
    printed = set(figures(output))
    missing = [f for f in quoted if f not in printed]
    assert not missing, f"records/README.md quotes {missing}, which --load {' / '.join(folders)} does not print"
    rows, other = ablation_rows(output)  # a label in two folders (12M and its short regime): both rows' figures
    wrong = []
    for line in body.splitlines():
        label = row_label(line.strip("| ").split("|")[0].strip(), rows) if line.startswith("|") else None
        wrong += [(label, f) for f in figures(line) if label and f not in rows[label]]
    marked = ROW_MARK.split(body)  # text, label, text, label, text ...
    for label, text in zip(marked[1::2], marked[2::2]):
        assert label in rows, f"records/README.md marks row {label!r}, which --load {' / '.join(folders)} does not print"
        wrong += [(label, f) for f in figures(text) if f not in rows[label] | other]
    assert not wrong, f"records/README.md quotes, for an ablation row, a figure --load prints elsewhere: {wrong}"


def test_every_results_folder_is_quoted():
    quoted = {f for folders, _ in regions() for f in folders}
    assert set(FOLDERS) <= quoted, f"no <!-- figures: ... --> region quotes {sorted(set(FOLDERS) - quoted)}"


# README.md's front page quotes the primary (SymPy) folders in its "Token efficiency" paragraph, and tiny
# Shakespeare's longest classic run for why no ratio is stated there.
FRONT_PAGE_FOLDERS = ("records/token_efficiency_sympy_500K", "records/token_efficiency_sympy_500K_demo_lr",
                      "records/token_efficiency_sympy_12M_tune", "records/token_efficiency_sympy_12M",
                      "records/token_efficiency_tinyshakespeare_2M_fp32")


def front_page_figures() -> list:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    paragraph = text.split("**Token efficiency**", 1)[1].split("\n\n", 1)[0] if "**Token efficiency**" in text else ""
    return figures(paragraph) or [pytest.param("", marks=pytest.mark.skip)]


@pytest.mark.parametrize("figure", front_page_figures())
def test_front_page_figures_are_what_load_prints(figure):
    printed = set(figures("\n".join(load_output(f) for f in FRONT_PAGE_FOLDERS)))
    assert figure in printed, f"README.md quotes {figure}, which --load {' / '.join(FRONT_PAGE_FOLDERS)} does not print"


@pytest.mark.parametrize("folder", FOLDERS)
def test_saved_floor_is_what_the_shards_give(folder):
    """floor.json of runs that record no floor: the count models of the first `tokens` training tokens
    in the shards' order, on the first val_tokens + 1 validation tokens (where the corpus is built)."""
    path = os.path.join(REPO, folder, te.FLOOR_FILE)
    if not os.path.exists(path):
        runs = te.read_runs(os.path.join(REPO, folder))
        assert all("floor" in r for r in runs.values()), f"{folder}: runs without a floor and no {te.FLOOR_FILE}"
        return
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    assert saved["val_set"] == "first" and saved["train_order"] == "file"
    run = next(iter(te.read_runs(os.path.join(REPO, folder)).values()))
    assert {k: saved[k] for k in ("train", "val", "val_tokens", "tokens")} == \
        {k: run[k] for k in ("train", "val", "val_tokens", "tokens")}
    try:
        train = te.token_stream(saved["train"], "train")[:saved["tokens"]]
        val = te.token_stream(saved["val"], "val")[:saved["val_tokens"] + 1]
    except SystemExit:
        pytest.skip(f"{saved['train']} not built here (data/README.md)")
    assert te.count_floor(train, val) == pytest.approx(saved["floor"], rel=1e-9)


# the line a classic run prints at each evaluation, and so writes into its log (`log` in its JSON)
EVALUATION_LINE = re.compile(r"^  step [\d,]+ of [\d,]+: ([\d,]+) tokens, val (\d+\.\d{4}), ", re.M)


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_log_a_saved_run_names_is_committed(folder):
    """Each saved run's log (`log`, and each sitting's for a run in several) is committed beside it, and a
    classic run's log has a line for each of its evaluations after step 0, with the saved loss."""
    for name, run in te.read_runs(os.path.join(REPO, folder)).items():
        logs = {run["log"]} if "log" in run else set()
        logs |= {s["log"] for s in run.get("sittings", []) if "log" in s}
        for log in logs:
            assert os.path.isfile(os.path.join(REPO, folder, log)), f"{folder}/{name}.json names {log}, not committed"
        if name.startswith("classic_") and "log" in run:
            with open(os.path.join(REPO, folder, run["log"]), encoding="utf-8") as f:
                printed = [(int(t.replace(",", "")), v) for t, v in EVALUATION_LINE.findall(f.read())]
            assert printed == [(t, f"{v:.4f}") for t, v in run["curve"][1:]], f"{folder}/{run['log']}"


SITTING_HEADER = re.compile(r"^#.*?\bcommit ([0-9a-f]{7,40})\b.*?\(log ([\w.-]+\.txt)", re.M)


@pytest.mark.parametrize("folder", FOLDERS)
def test_terminal_output_headers_name_the_commit_the_run_saved(folder):
    """A terminal-output file's sitting header (`# date, commit H, machine ... (log NAME)`) names the commit that
    the saved run records for the sitting that wrote NAME: the header is typed by hand, the JSON's commit is
    what the run read from git. A header whose log no saved run names yet (a run in progress) is skipped."""
    commit_of_log = {}
    for run in te.read_runs(os.path.join(REPO, folder)).values():
        if "log" in run and "commit" in run:
            commit_of_log[os.path.basename(run["log"])] = run["commit"]
        for sitting in run.get("sittings", []):
            if "log" in sitting and "commit" in sitting:
                commit_of_log[os.path.basename(sitting["log"])] = sitting["commit"]
    checked = 0
    for path in glob.glob(os.path.join(REPO, folder, "logs", "*stdout*.txt")):
        with open(path, encoding="utf-8") as f:
            for commit, log in SITTING_HEADER.findall(f.read()):
                if log in commit_of_log:
                    checked += 1
                    assert commit_of_log[log].startswith(commit), (
                        f"{os.path.relpath(path, REPO)}: the header of {log} names commit {commit}; "
                        f"its run saved {commit_of_log[log][:7]}")
    if folder == "records/token_efficiency_sympy_12M":
        assert checked >= 6, checked  # the ablations' headers name their logs


def run_table_rows() -> list:
    """(folder README, header cells, row cells) of every row naming a saved run (`classic_...`, `rsearch_...`) in a
    results folder's own README: the tables beside the runs, outside records/README.md's marked regions."""
    rows = []
    for folder in FOLDERS:
        path = os.path.join(REPO, folder, "README.md")
        if not os.path.exists(path):
            continue
        header = None
        for line in open(path, encoding="utf-8"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
            if cells and cells[0] == "run":
                header = cells
            elif cells and header and re.fullmatch(r"`[\w.]+`", cells[0]):
                rows.append(pytest.param(folder, header, cells, id=f"{folder}:{cells[0].strip('`')}"))
            elif not cells:
                header = None
    return rows or [pytest.param("", [], [], marks=pytest.mark.skip)]


@pytest.mark.parametrize("folder,header,row", run_table_rows())
def test_run_tables_are_what_the_saved_runs_hold(folder, header, row):
    """Each row of a folder README's run table against its run's JSON: the settings (the classic's lr,
    batch, context and step count; the recipe's two rates), the best validation loss (4 decimals, bold or
    not), the tokens it was first reached at and the last loss."""
    path = os.path.join(REPO, folder, row[0].strip("`") + ".json")
    assert os.path.exists(path), f"{folder}/README.md lists {row[0]}, which is not saved there"
    with open(path, encoding="utf-8") as f:
        run = json.load(f)
    tokens, best = te.best_point(run["curve"])  # as --load reports it: the earliest of equal losses
    want = {"best val": f"{best:.4f}", "at tokens": f"{tokens:,}", "last val": f"{run['curve'][-1][1]:.4f}"}
    if "classic_lr" in run:
        batch = run["classic_batch_tokens"]
        want.update({"lr": f"{run['classic_lr']:g}", "batch (tokens)": f"{batch:,}", "context": f"{run['classic_seq_len']:,}",
                     "steps": f"{max(1, run['tokens'] // batch):,}"})
    else:
        want.update({"NorMuon lr": f"{run['recipe_muon_lr']:g}", "Adam lr": f"{run['recipe_adam_lr']:g}"})
    got = {h: c.replace("**", "") for h, c in zip(header, row) if h in want}
    assert {"best val", "at tokens"} <= set(got), f"{folder}/README.md: a run table without {header}"
    assert got == {h: want[h] for h in got}, f"{folder}/README.md, {row[0]}"


def compare_regions() -> list:
    """(folder, "A,B", text) of each marked comparison in records/README.md and the results folders' READMEs."""
    found = []
    for path in [os.path.join(REPO, "records", "README.md"), *(os.path.join(REPO, f, "README.md") for f in FOLDERS)]:
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                where = os.path.relpath(path, REPO)
                found += [pytest.param(folder, pair, body, id=f"{where}:{pair}")
                          for folder, pair, body in COMPARE_REGION.findall(f.read())]
    return found


def rounds_a_printed_value(figure: str, printed: set[str]) -> bool:
    """A figure is printed as it is, or, of 2-3 places, rounds a printed 4-place value (itself rounded,
    so half a unit of its last place is slack)."""
    places = len(figure.split(".")[1])
    return figure in printed or places < 4 and any(
        abs(float(v) - float(figure)) <= 0.5 * 10 ** -places + 0.5e-4 for v in printed if len(v.split(".")[1]) == 4)


def test_the_comparisons_are_marked():
    assert len(compare_regions()) >= 10, "records/README.md: the 12M search's comparisons are not marked"


@pytest.mark.parametrize("folder,pair,body", compare_regions())
def test_quoted_comparisons_are_what_compare_prints(folder, pair, body):
    assert folder in FOLDERS, f"{folder}: not a committed token-efficiency folder ({FOLDERS})"
    printed = te.compare_runs(os.path.join(REPO, folder), pair)
    numbers = set(re.findall(r"\d+\.\d+", printed))
    decimals = DECIMAL.findall(body)
    counts = [f for f in figures(body) if "." not in f]
    assert decimals, "a marked comparison with no figure to check"
    wrong = [f for f in decimals if not rounds_a_printed_value(f, numbers)]
    wrong += [f for f in counts if f not in printed]
    assert not wrong, f"a README quotes {wrong} for {pair}, which --load {folder} --compare does not print"


@pytest.mark.parametrize("folder,pair,body", compare_regions())
def test_each_comparison_ends_as_the_saved_runs_do(folder, pair, body):
    """Each marked comparison says how A ends against B, and that is its best val loss against B's, read
    from the two JSONs: ahead or behind, by how much (rounded as quoted) and, where quoted, A's best."""
    best = []
    for name in pair.split(","):
        with open(os.path.join(REPO, folder, name + ".json"), encoding="utf-8") as f:
            best.append(min(loss for _, loss in json.load(f)["curve"]))
    m = ENDS.search(body)
    assert m, f"the comparison of {pair} does not say how it ends (\"ends 0.027 behind\")"
    quoted_best, by, side, best_after = m.groups()
    gap = best[0] - best[1]
    assert side == ("ahead" if gap < 0 else "behind"), f"{pair}: A's best is {best[0]:.4f}, B's {best[1]:.4f}"
    assert abs(abs(gap) - float(by)) <= 0.5 * 10 ** -len(by.split(".")[1]) + 1e-9, f"{pair}: ends {abs(gap):.4f} {side}"
    for quoted in (quoted_best, best_after):
        assert quoted in (None, f"{best[0]:.4f}"), f"{pair}: A's best is {best[0]:.4f}, not {quoted}"
