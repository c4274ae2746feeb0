"""Alias packages (a package whose only job is to bind a second import name to a module) exist only
where a documented public import path needs them: each is listed here with the page that documents its
path, the path imports as written in a fresh interpreter, and no other package of verl_fast is one."""

import subprocess
import sys
from pathlib import Path

import verl_fast

PKG = Path(verl_fast.__file__).parent
DOCS = Path(__file__).resolve().parents[2] / "docs"

# alias package -> (the import path the docs give, the module it is, the page that documents it)
ALIASES = {
    "verl_fast/schedule": ("from verl_fast.schedule import rollout_buckets", "verl_fast.ops.schedule", "ops.md"),
    "verl_fast/inference": ("from verl_fast.inference.vllm_engine import VLLMInferenceEngine",
                            "verl_fast.rollout.vllm_engine", "rollout.md"),
}


def test_only_documented_paths_have_alias_packages():
    found = sorted(str(init.parent.relative_to(PKG.parent)) for init in PKG.rglob("__init__.py")
                   if "sys.modules[" in init.read_text())
    assert found == sorted(ALIASES), f"alias packages {found}: each needs a documented import path (ALIASES)"
    for statement, _, page in ALIASES.values():
        name = statement.split()[1]
        assert name in (DOCS / page).read_text(), f"docs/{page} does not give {name}"


def test_the_documented_paths_import_the_module_itself(tmp_path):
    code = ["import importlib"]
    for statement, module, _ in ALIASES.values():
        alias = statement.split()[1]
        code += [statement, f"assert importlib.import_module({alias!r}) is importlib.import_module({module!r})"]
    done = subprocess.run([sys.executable, "-c", "\n".join(code)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
