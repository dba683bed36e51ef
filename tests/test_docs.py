"""The docs show the state (GUIDE "How we write code"): README is a guide under 350 lines with one table of current
numbers (card, commit, date), benchmarks/RESULTS.md opens with the current table, and every relative link in the
top-level docs points at a file that exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_is_short_with_one_table_of_current_numbers():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 350, f"README.md has {len(lines)} lines: move long prose to docs/"
    headers = [l for l in lines if re.match(r"\| *Case *\| *Figure *\|.*\| *Card *\| *Commit *\| *Date *\|", l)]
    assert len(headers) == 1, "README.md needs one table of current numbers (Case | Figure | ... | Card | Commit | Date)"


def test_results_opens_with_the_current_table():
    head = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8").splitlines()[:80]
    assert any(re.match(r"\| *case *\| *figure *\| *floor ratio *\| *card *\| *commit *\| *date *\|", l) for l in head)


def test_relative_links_resolve():
    docs = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "benchmarks" / "RESULTS.md",
            *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for doc in docs:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            if "://" not in target and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken
