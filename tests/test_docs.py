"""The docs a newcomer reads: README stays short and keeps the test line `.ci/run` runs, every number
in its results table links the file that holds it, every link of README and docs/ reaches a file
(and a heading) of the repository, every `python -m` command they name is a module that runs as one,
docs/design.md states contracts rather than measurements, and bench/results/ holds exactly what the docs
cite: every cited result exists, every result is cited."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.tiny_run import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = ROOT / "bench" / "results"
INDEX = RESULTS / "INDEX.md"
TEST_LINE = "pip install torch==2.13.0 -c constraints.txt -e '.[test]' && python -m pytest -q -n 2 --dist loadfile"

LINK = re.compile(r"\]\(([^)\s]+)\)")
CITED_RESULT = re.compile(r"bench/results/([^\s`'\")\]]+)")
BACKTICKED = re.compile(r"`([^`]+)`")
# `python -m entry.plan`, `torchrun --nproc_per_node=2 -m entry.pipeline`: this project's modules run as commands.
COMMAND = re.compile(r"(?:python3? |torchrun [^`\n]*?)-m ((?:entry|bench|pipelines)(?:\.\w+)+)")


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [README, *sorted(DOCS.glob("*.md"))]


def expand(pattern: str) -> list[str]:
    """A pattern's brace alternatives: ``a{b,c}d`` -> [abd, acd] (nested and repeated braces too)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in expand(pattern[:m.start()] + alt + pattern[m.end():])]


def matches(pattern: str) -> set[str]:
    """Names of the files in bench/results/ that `pattern` (braces, ``*`` globs) names."""
    return {p.name for alt in expand(pattern) for p in RESULTS.glob(alt) if p.is_file()}


def cited_patterns() -> dict[str, list[str]]:
    """Page -> the bench/results/ patterns it cites: paths under bench/results/ in README and docs/
    (templates such as ``<device>-<date>`` left out), and the index's backticked file column."""
    out = {}
    for page in pages():
        found = [m.rstrip(".,;:") for m in CITED_RESULT.findall(page.read_text())]
        out[str(page.relative_to(ROOT))] = [m for m in found if m and "<" not in m]
    rows = [line.rsplit("|", 2)[-2] for line in INDEX.read_text().splitlines()
            if line.startswith("|") and line.count("|") >= 4]
    out["bench/results/INDEX.md"] = [t for row in rows for t in BACKTICKED.findall(row)]
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (code blocks skipped)."""
    found, in_code = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            found.add(slug(line.lstrip("#")))
    return found


def test_readme_is_short_and_keeps_the_test_line_ci_runs():
    lines = README.read_text().splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines; move reference text to docs/"
    # .ci/run runs the first `pip install` line that names pytest: it must stay this one.
    first = next(line for line in lines if line.startswith("pip install") and "pytest" in line)
    assert first == TEST_LINE


def test_every_row_of_the_readme_results_table_links_its_result_file():
    section = README.read_text().split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # past header and rule
    assert len(rows) >= 5
    for row in rows:
        targets = [t for t in LINK.findall(row) if t.startswith("bench/results/")]
        assert targets, f"a results row without a link into bench/results/: {row[:80]}"
        for target in targets:
            assert (ROOT / target).is_file(), target


def test_every_link_of_readme_and_docs_reaches_a_file_and_heading():
    broken = []
    for page in pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_every_command_the_docs_name_is_a_module_with_a_main_guard():
    """A renamed or moved command leaves the docs naming one that fails: each `python -m X` of this
    project's packages must be a module whose top level runs ``if __name__ == "__main__":``."""
    wrong = []
    for page in pages():
        for module in sorted(set(COMMAND.findall(page.read_text())) - {"entry.X"}):  # entry.X: "any stage"
            path = ROOT / (module.replace(".", "/") + ".py")
            if not path.is_file():
                wrong.append(f"{page.relative_to(ROOT)}: {module} (no such module)")
            elif not any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
                         for node in ast.parse(path.read_text()).body):
                wrong.append(f"{page.relative_to(ROOT)}: {module} (no `if __name__ == \"__main__\":`)")
    assert wrong == []


def test_design_states_contracts_not_measurements():
    text = (ROOT / "docs/design.md").read_text()
    assert "bench/results" not in text, "measured results belong in docs/benchmarks.md"
    assert not re.search(r"\bissues? \d+", text), "issue numbers belong in commit messages, not the design"


def test_every_cited_result_file_exists():
    missing = [f"{page}: {pattern}" for page, patterns in cited_patterns().items() for pattern in patterns
               if not matches(pattern)]
    assert missing == []


def test_every_result_file_is_cited_by_a_page_or_the_index():
    cited = set().union(*(matches(p) for patterns in cited_patterns().values() for p in patterns))
    uncited = sorted(p.name for p in RESULTS.iterdir() if p.is_file() and p.name not in cited)
    assert uncited == [], "cite each in bench/results/INDEX.md (page and section) or git rm it"


def test_the_citation_helpers_expand_braces_and_slug_headings():
    assert expand("a{b,c}{,_s1}.md") == ["ab.md", "ab_s1.md", "ac.md", "ac_s1.md"]
    assert slug("## The race on a ladder of budgets (`bench.race`)".lstrip("#")) == \
        "the-race-on-a-ladder-of-budgets-benchrace"
    assert slug("2D Kolmogorov flow, CPU, 2 cores, 2026-11-26, 3 seeds") == \
        "2d-kolmogorov-flow-cpu-2-cores-2026-11-26-3-seeds"
