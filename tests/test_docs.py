"""The documentation holds together: every relative link of the READMEs reaches an existing file (and an
#anchor a heading of it), README.md stays a front page, its map of train_gpt.py names real sections, and
records/README.md's figures of the file's sections are the file's."""
import glob
import os
import re
from urllib.parse import unquote

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "records/README.md", "tests/README.md", "data/README.md"]
FRONT_PAGE_MAX_BYTES = 15_360

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r'\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(([^()\s]*(?:\([^()\s]*\)[^()\s]*)*)(?:\s+"[^"]*")?\)')
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", re.M)


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def prose(text):
    """The text without fenced code blocks and code spans (a link inside code is not a link)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading):
    """GitHub's anchor for a heading: markup dropped, lowercase, spaces to '-', and every character other
    than a letter, a digit, '-' or '_' removed."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    return "".join(c for c in text.replace(" ", "-") if c.isalnum() or c in "-_")


def anchors(path):
    """Every anchor the headings of a markdown file define; a repeated heading gets -1, -2, ... as on GitHub."""
    seen, out = {}, set()
    for m in HEADING.finditer(FENCE.sub("", read(path))):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(path):
    """(target, line number) of every markdown link or image in the file that is not a URL."""
    text = read(path)
    # blank out code, keeping the offsets, so line numbers stay right
    blanked = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    blanked = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), blanked)
    for m in LINK.finditer(blanked):
        target = m.group(1)
        if not target or re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:, ...
            continue
        yield target, blanked.count("\n", 0, m.start()) + 1


def broken_links(path):
    """'file:line: target (why)' for every relative link of a markdown file that does not resolve."""
    problems = []
    here = os.path.dirname(path)
    for target, line in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(here, unquote(file_part))) if file_part else path
        where = f"{os.path.relpath(path, ROOT)}:{line}: {target}"
        if not os.path.exists(dest):
            problems.append(f"{where} (no such file: {os.path.relpath(dest, ROOT)})")
        elif anchor:
            if not dest.endswith(".md") or os.path.isdir(dest):
                problems.append(f"{where} (an anchor into a file that is not markdown)")
            elif unquote(anchor).lower() not in anchors(dest):
                problems.append(f"{where} (no heading with anchor #{anchor} in {os.path.relpath(dest, ROOT)})")
    return problems


def doc_files():
    """The four READMEs, plus the README of every record folder."""
    found = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "records", "*", "README.md")))
    return DOCS + found


@pytest.mark.parametrize("doc", doc_files())
def test_relative_links_resolve(doc):
    path = os.path.join(ROOT, doc)
    assert os.path.isfile(path), f"{doc} is missing"
    assert not broken_links(path), "broken links:\n" + "\n".join(broken_links(path))


def test_front_page_is_at_most_15_kib():
    size = os.path.getsize(os.path.join(ROOT, "README.md"))
    assert size <= FRONT_PAGE_MAX_BYTES, (
        f"README.md is {size:,} bytes, over the front page's {FRONT_PAGE_MAX_BYTES:,}: move details beside "
        "what they describe (records/README.md, tests/README.md, data/README.md)")


def test_map_names_sections_of_train_gpt():
    """README.md's map of train_gpt.py lists every section, a banner ('# ---...' then '# Title'), in the
    file's order, with its line range: from its banner's first line to the line before the next banner."""
    lines = read(os.path.join(ROOT, "train_gpt.py")).rstrip("\n").split("\n")
    starts = [i + 1 for i in range(len(lines) - 1)
              if lines[i].startswith("# ------") and lines[i + 1].startswith("# ") and not lines[i + 1].startswith("# --")]
    want = [(start, end, lines[start][2:].strip())
            for start, end in zip(starts, [s - 1 for s in starts[1:]] + [len(lines)])]
    section = read(os.path.join(ROOT, "README.md")).split("## Map of `train_gpt.py`", 1)[1].split("\n## ", 1)[0]
    rows = [(int(m.group(1)), int(m.group(2)), m.group(3).strip())
            for m in re.finditer(r"^\| (\d+)-(\d+) \| ([^|]+) \|", section, re.M)]
    assert rows, "README.md's map of train_gpt.py has no rows"
    assert rows[0][:2] == (1, starts[0] - 1)  # the docstring and imports
    assert rows[1:] == want, f"README.md's map lists {rows[1:]}, train_gpt.py's sections are {want}"



# records/README.md's "Sections" table: each row's sections of train_gpt.py, by the start of their titles
SECTION_ROWS = {"header, imports": ("",), "distributed set-up": ("Distributed setup",), "FP8 ops": ("FP8 custom ops",),
                "Polar Express": ("Orthogonalization",), "optimizer, sparse exchange": ("Optimizer",),
                "model": ("Model",), "shards, loader": ("Shard files", "Data loader"),
                "recipe, schedule, training, main": ("The recipe", "Schedule", "Training", "main")}


def test_section_figures_are_the_files():
    """records/README.md's size of train_gpt.py and its per-section table ("ours") are counted from the
    file's banners."""
    lines = read(os.path.join(ROOT, "train_gpt.py")).rstrip("\n").split("\n")
    banners = [i for i in range(len(lines) - 1) if lines[i].startswith("# ------") and lines[i + 1].startswith("# ")
               and not lines[i + 1].startswith("# --")]
    sizes = {"": banners[0]}
    for start, end in zip(banners, banners[1:] + [len(lines)]):
        sizes[lines[start + 1][2:]] = end - start
    doc = read(os.path.join(ROOT, "records/README.md")).split("**Sections.**", 1)[1].split("\n## ", 1)[0]
    stated = re.search(r"The file is ([\d,]+) lines", doc)
    assert stated and int(stated.group(1).replace(",", "")) == len(lines), f"the file is {len(lines)} lines"
    table = {m.group(1): int(m.group(2).replace(",", ""))
             for m in re.finditer(r"^\| ([^|]+?) \| [\d,]+ \| ([\d,]+) \|", doc, re.M)}
    assert table.pop("total") == len(lines)
    want = {row: sum(n for title, n in sizes.items() if any(title.startswith(p) if p else not title for p in prefixes))
            for row, prefixes in SECTION_ROWS.items()}
    assert sum(want.values()) == len(lines) and table == want, f"the file's sections give {want}"


def rename_table_names(doc: str) -> list[str]:
    """The identifiers in the "ours" column of records/README.md's table of renames (code spans, each
    identifier of three or more characters before any '(')."""
    section = doc.split("## Names: the record's and ours", 1)[1].split("\n## ", 1)[0]
    names = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or len(cells) < 2 or cells[0] == "record #89":
            continue
        for span in re.findall(r"`([^`]+)`", cells[1]):
            names += [n for n in re.findall(r"[A-Za-z_]\w*", span.split("(")[0]) if len(n) >= 3]
    return names


def test_rename_table_names_exist_in_the_code():
    """Every name the rename table gives as ours is a word of train_gpt.py or triton_kernels.py: a rename
    or a removal in the code that leaves the table behind fails here."""
    code = read(os.path.join(ROOT, "train_gpt.py")) + read(os.path.join(ROOT, "triton_kernels.py"))
    words = set(re.findall(r"\w+", code))
    names = rename_table_names(read(os.path.join(ROOT, "records/README.md")))
    assert len(names) > 100, names  # the table has 137 rows
    missing = sorted({n for n in names if n not in words})
    assert not missing, f"records/README.md's rename table names {missing}, which the code does not have"

# ---------------------------------------------------------------------------------------------- the checker

def test_checker_finds_broken_links_and_anchors(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("# B\n\n## Fidelity to record #89\n\n## Model (`GPT` in `train_gpt.py`)\n\n"
                                          "## Notes\n\n## Notes\n")
    (tmp_path / "a.md").write_text(
        "# A title\n\n"
        "[ok](sub/b.md) [ok](sub/b.md#fidelity-to-record-89) [ok](sub/b.md#model-gpt-in-train_gptpy)\n"
        "[ok](#a-title) [ok](sub/b.md#notes-1) ![img](sub/b.md) [web](https://example.com/x.md) [m](mailto:a@b)\n"
        "`[not a link](nowhere.md)`\n\n```\n[not a link](nowhere.md)\n```\n"
        "[bad file](sub/c.md)\n[bad anchor](sub/b.md#fidelity)\n[bad here](#b)\n[bad dup](sub/b.md#notes-2)\n")
    problems = broken_links(str(tmp_path / "a.md"))
    assert [p.split(": ", 1)[1].split(" (")[0] for p in problems] == [
        "sub/c.md", "sub/b.md#fidelity", "#b", "sub/b.md#notes-2"], problems
    assert "a.md:10: sub/c.md (no such file" in problems[0], problems  # file and line of the link


def test_slug_follows_githubs_rule():
    assert slug("Fidelity to record #89") == "fidelity-to-record-89"
    assert slug("Forward pass (the record's section 1.5, in this order)") == "forward-pass-the-records-section-15-in-this-order"
    assert slug("Model (`GPT` in `train_gpt.py`)") == "model-gpt-in-train_gptpy"
    assert slug("Design notes (the code these records ran)") == "design-notes-the-code-these-records-ran"
