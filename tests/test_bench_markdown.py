"""BENCHMARKS.md as rendered from the recorded JSONs: every table well-formed (a separator row with one cell per
header cell, and rows of that width), so markdown renderers show them as tables; the committed page is the
rendering of the records."""
from pathlib import Path

from rollplex_megatron.bench_markdown import render_markdown

ROOT = Path(__file__).resolve().parent.parent


def _cells(line: str) -> int:
    return line.strip().strip("|").count("|") + 1


def tables(text: str) -> list[list[str]]:
    """The markdown tables of `text`, each as its lines."""
    out, cur = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cur.append(line)
        elif cur:
            out.append(cur)
            cur = []
    return out


def test_every_rendered_table_is_well_formed():
    text = render_markdown(ROOT / "benchmarks" / "results")
    found = tables(text)
    assert len(found) > 10
    for t in found:
        assert set(t[1].replace("|", "").replace("-", "").replace(":", "").strip()) == set(), t[:2]
        assert {_cells(line) for line in t} == {_cells(t[0])}, t[:3]
    assert (ROOT / "BENCHMARKS.md").read_text() == text
    # the check can fail: a separator one cell short
    broken = text.replace("|---|---|---|", "|---|---|", 1)
    assert any(len({_cells(line) for line in t}) > 1 for t in tables(broken))
