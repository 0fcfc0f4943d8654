"""The documentation holds to what it cites: design sections, result records, bench variants, a short README.

The site itself is built with `mkdocs build --strict` by scripts/test.sh (broken links, pages outside the nav);
these tests check what mkdocs cannot: that citations in code resolve, that named records exist, and that the
README stays a landing page.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from rollplex_megatron import bench_markdown, bench_modes

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
RESULTS = ROOT / "benchmarks" / "results"
CITING = ("rollplex_megatron", "tests", "benchmarks", "scripts", "recipes", "docs")
CITATION = re.compile(r"design\.md §(\d+)")
OLD_FORM = re.compile(r"\b" + "DES" + r"IGN\b")  # split so this file does not cite in the old form itself
HEX_WORD = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
RECORD_NAME = re.compile(r"`([A-Za-z0-9_.-]+\.(?:json|jsonl|txt|csv))`")
# files of a run directory, a checkpoint or the package that the pages name; not records under results/
NOT_RECORDS = {"config.json", "generation_config.json", "metrics.jsonl", "memory_plan.json", "summary.json",
               "meta.json", "rollplex_mcore.json", "rollplex_export.json", "window_policy.json", "constraints.txt"}
README_MAX_LINES = 160


def _texts(roots=CITING):
    """(path, text) of every text file under `roots`, the JSON records excepted."""
    for root in roots:
        for path in sorted((ROOT / root).rglob("*")):
            if path.is_file() and RESULTS not in path.parents and path.suffix in (".py", ".sh", ".yaml", ".md"):
                yield path, path.read_text(encoding="utf-8")


def design_sections(text: str) -> set[int]:
    """Section numbers of `## N. Title {#section-N}` headings (number and anchor must agree)."""
    return {int(n) for n, a in re.findall(r"^## (\d+)\. .*\{#section-(\d+)\}\s*$", text, re.M) if n == a}


def missing_citations(sections: set[int], texts) -> list[str]:
    """`file:line: §N` for every `design.md §N` citation whose section does not exist."""
    return [f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: §{m.group(1)}"
            for p, text in texts for m in CITATION.finditer(text) if int(m.group(1)) not in sections]


def readme_problems(text: str) -> list[str]:
    """Why README.md is not a landing page: too long, or naming commit hashes."""
    lines = text.splitlines()
    problems = [f"{len(lines)} lines (at most {README_MAX_LINES})"] if len(lines) > README_MAX_LINES else []
    return problems + [f"line {i}: hash-like word {w!r}" for i, ln in enumerate(lines, 1) for w in HEX_WORD.findall(ln)]


def test_every_design_citation_names_a_section_that_exists():
    """Code, tests, scripts, recipes and docs cite `docs/design.md §N`; each N is a heading with its anchor."""
    sections = design_sections(DESIGN.read_text(encoding="utf-8"))
    assert sections >= {1, 2, 3, 4, 5, 6}, f"docs/design.md sections found: {sorted(sections)}"
    texts = list(_texts())
    assert sum(len(CITATION.findall(t)) for _, t in texts) >= 20  # the citations this test exists for
    assert missing_citations(sections, texts) == []
    # mutation: a citation of a section that does not exist is reported with its place
    cite = "see docs/design.md \u00a79"  # written so that this file does not cite §9 itself
    assert missing_citations(sections, [(DESIGN, cite)]) == ["docs/design.md:1: \u00a79"]


def test_no_citation_in_the_old_form_is_left():
    """The design moved into docs/design.md: no "DESIGN section N" (a file outside the repository) remains."""
    stale = [f"{p.relative_to(ROOT)}:{t.count(chr(10), 0, m.start()) + 1}" for p, t in _texts() for m in
             OLD_FORM.finditer(t) if p != Path(__file__).resolve()]
    stale += [f"README.md:{i}" for i, ln in enumerate((ROOT / "README.md").read_text().splitlines(), 1)
              if OLD_FORM.search(ln)]
    assert stale == []


def test_readme_is_a_landing_page():
    """README.md: at most 160 lines and no commit hash (history lives in git, records in their JSONs); the two
    set-up commands stay first."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme_problems(text) == []
    assert "bash scripts/main_job.sh" in text.split("\n## ")[0] and "bash scripts/test.sh" in text.split("\n## ")[0]
    # mutation: a long README that names a commit fails on both counts
    bad = readme_problems("x\n" * 200 + "measured at commit 3cb4560\n")
    assert len(bad) == 2 and "201 lines" in bad[0] and "3cb4560" in bad[1]


def test_every_record_the_pages_name_exists():
    """Each `*.json` / `*.txt` / `*.csv` record the README and docs name is a file under benchmarks/results/."""
    pages = [(ROOT / "README.md", (ROOT / "README.md").read_text(encoding="utf-8")), *_texts(("docs",))]
    named = {(p.relative_to(ROOT), n) for p, t in pages for n in RECORD_NAME.findall(t) if n not in NOT_RECORDS}
    assert len(named) >= 30
    assert sorted(f"{p}: {n}" for p, n in named if not (RESULTS / n).is_file()) == []


def test_benchmarks_md_is_the_rendering_of_the_records():
    """BENCHMARKS.md (included in the docs site) is what `bench --render` writes from benchmarks/results/."""
    assert (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8") == bench_markdown.render_markdown(RESULTS), (
        "BENCHMARKS.md is stale: run python -m rollplex_megatron bench --render")
    assert '--8<-- "BENCHMARKS.md"' in (ROOT / "docs" / "benchmarks" / "suites.md").read_text(encoding="utf-8")


def test_the_bench_page_describes_modes_with_overrides_and_maps_every_old_variant():
    """docs/benchmarks/index.md: every `MODE[...]` and `--modes "..."` it shows parses as bench parses it; its table
    of old variant labels names every variant bench reads in older records, and only those, each with the override
    bench reads it as; the refusal it quotes for an old label is bench's."""
    page = (ROOT / "docs" / "benchmarks" / "index.md").read_text(encoding="utf-8")
    shown = re.findall(r"`((?:serial|prefix_shared|rollplex)\[[^`]*\])`", page)
    shown += [m for m in re.findall(r'--modes "([^"]+)"', page) if "KEY=VALUE" not in m]
    assert len(shown) >= 4 and all(bench_modes.parse_modes(m) for m in shown)
    rows = re.findall(r"^\| (`:.*?) \| (`.*?) \|$", page, re.M)
    listed = {}
    for variants, overrides in rows:  # `:keep`, `:memauto` | `memory.plan=keep`, `memory.plan=auto`
        names, sets = re.findall(r"`:([a-z0-9]+)(?:<N>)?`", variants), re.findall(r"`([^`]+)`", overrides)
        listed.update(zip(names, sets * len(names) if len(sets) == 1 else sets))
    assert set(listed) == set(bench_modes.OLD_VARIANTS) | set(bench_modes.OLD_SIZED) and len(listed) >= 20
    for variant, override in listed.items():  # N-taking variants with an N; `<window>` is each window
        label = f"rollplex:{variant}{'8' if variant in bench_modes.OLD_SIZED else ''}"
        want = override.replace("=N", "=8").replace("<window>", variant)
        assert bench_modes.label_spec(label) == ("rollplex", (want,)), label
    old = "rollplex:tokens8192+pack16640+split"
    with pytest.raises(ValueError) as e:
        bench_modes.parse_modes(old)
    quoted = re.search(r'refuses a variant label.*?(--modes "[^"]+")', page, re.S).group(1)
    assert str(e.value).endswith(quoted) and old in page
