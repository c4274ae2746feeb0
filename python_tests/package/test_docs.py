"""README.md and docs/ as a reader meets them: every YAML block is a config that validates, every
relative link reaches a file (and a heading of it, when it names one), and no word of the project's
own working vocabulary is left in them."""

import re
from pathlib import Path

import pytest
import yaml

from verl_fast import config

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
INTERNAL = re.compile(r"\bseeds\b|\bseed (?:\d|doc|\()|\bSPEC\b|\brooms?\b|\bissues? #?\d+")


def _ids(pages):
    return [str(p.relative_to(ROOT)) for p in pages]


def _anchor(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading (GitHub's rule: lower case, punctuation
    dropped, spaces to hyphens)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_docs_folder_holds_the_pages_readme_links():
    links = re.findall(r"\]\((docs/[^)#]+)", (ROOT / "README.md").read_text())
    assert "docs/configuration.md" in links and "docs/index.md" in links
    assert (ROOT / "README.md").stat().st_size <= 20_000


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_no_internal_vocabulary(page):
    found = [f"{page.name}:{i}: {line.strip()}" for i, line in enumerate(page.read_text().splitlines(), 1)
             if INTERNAL.search(line)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_relative_links_reach_a_file_and_heading(page):
    text = page.read_text()
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md":
            headings = {_anchor(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)}
            if anchor not in headings:
                bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not bad, f"{page.name}: " + "; ".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_yaml_blocks_are_configs_that_validate(page):
    for block in re.findall(r"```yaml\n(.*?)```", page.read_text(), flags=re.S):
        data = yaml.safe_load(block)
        try:
            config.from_dict(data)
        except ValueError as e:
            pytest.fail(f"{page.name}: a YAML block does not validate: {e}\n{block}")
