"""docs/configuration.md is the reference generated from the config dataclasses' own fields
(scripts/gen_config_docs.py): the checked-in page is current, and it lists every key of every section."""

import dataclasses
import importlib.util
from pathlib import Path

from verl_fast import config

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_checked_in_reference_is_current():
    text = _generator().render()
    assert (ROOT / "docs" / "configuration.md").read_text() == text, (
        "docs/configuration.md is not current: run python scripts/gen_config_docs.py")


def test_the_reference_names_every_key_its_default_and_doc():
    text = _generator().render()
    for section in dataclasses.fields(config.Config):
        body = text[text.index(f"\n## {section.name}\n"):]
        body = body[: body.find("\n## ", 1) if "\n## " in body[1:] else len(body)]
        for f in dataclasses.fields(section.default_factory()):
            assert f"| `{f.name}` |" in body, f"{section.name}.{f.name} missing from the reference"
    row = next(line for line in text.splitlines() if line.startswith("| `kl_loss_type` |"))
    assert "`low_var_kl`" in row and "low_var_kl" in row.split("|")[4]  # default and the registered choices
    row = next(line for line in text.splitlines() if line.startswith("| `warmup_ratio` |"))
    assert ">= 0.0; <= 1.0" in row and "warm-up as a fraction" in row
