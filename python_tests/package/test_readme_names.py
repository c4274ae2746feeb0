"""Every Python name README.md and docs/ give is importable as written, in a fresh interpreter: each
dotted ``verl_fast.…`` name (a module along the way must import as a module: ``import verl_fast.x``),
and each ``vf.…`` name (``import verl_fast as vf``) and each name of the Ops table's Python column
(docs/ops.md) as an attribute of ``verl_fast``."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

RESOLVE = """
import importlib, json, sys, types
import verl_fast
failed = []
for name, as_attribute in json.loads(sys.argv[1]):
    parts = name.split(".")
    try:
        obj = verl_fast
        for i, part in enumerate(parts[1:], start=2):
            dotted = ".".join(parts[:i])
            if as_attribute:
                obj = getattr(obj, part)
                continue
            try:
                obj = importlib.import_module(dotted)
            except ModuleNotFoundError as e:
                if e.name != dotted:
                    raise
                obj = getattr(obj, part)
                if isinstance(obj, types.ModuleType):  # a module reached as an attribute only
                    raise ImportError(f"import {dotted} fails, although the name is a module")
    except Exception as e:  # noqa: BLE001 - every failure is reported
        failed.append(f"{name}: {type(e).__name__}: {e}")
print(json.dumps(failed))
"""


def readme_names():
    """``(name, as_attribute)`` pairs: dotted import paths, and attributes of the package."""
    text = "\n\n".join(page.read_text() for page in PAGES)
    dotted = set(re.findall(r"`[^`]*?\b(verl_fast(?:\.[A-Za-z_]\w*)+)", text))
    attributes = set(re.findall(r"\bvf\.([A-Za-z_]\w*)", text))  # import verl_fast as vf
    ops = (ROOT / "docs" / "ops.md").read_text()
    ops = ops[ops.index("\n| area | Python |") + 1:]  # the table, to its end
    ops = ops[: ops.index("\n\n")]
    for row in ops.splitlines()[2:]:  # the rows under the header and its rule
        python = row.split("|")[2]
        for code in re.findall(r"`([^`]+)`", python):
            head = re.match(r"([A-Za-z_][\w/]*)(?:[.(]|$)", code)  # e.g. masked_mean/var/whiten, reshard(...)
            if head is None or head.group(1) in ("vf", "verl_fast") or code.startswith("verl-fast"):
                continue  # shapes, the names found above, commands
            first, *rest = head.group(1).split("/")
            stem = first.rsplit("_", 1)[0] + "_" if rest else ""
            attributes.update([first] + [stem + r for r in rest])
    return sorted([name, False] for name in dotted) + sorted([f"verl_fast.{n}", True] for n in attributes)


def test_readme_names_import(tmp_path):
    names = readme_names()
    assert ["verl_fast.compute_gae", True] in names and ["verl_fast.inference.vllm_engine", False] in names, names
    # outside the repository: from its root, `import verl_fast` would find the unbuilt source folder
    done = subprocess.run([sys.executable, "-c", RESOLVE, json.dumps(names)], capture_output=True, text=True,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failed, "README / docs names that do not import as written:\n" + "\n".join(failed)
