"""`verl-fast train`: parse the command line into a config (or the embedded default), run it
(``verl_fast.trainer.launch``), and print the summary."""

from __future__ import annotations

import argparse
import os
from typing import Any, Dict, List

from verl_fast import config as config_mod
from verl_fast.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config (default: the embedded GRPO SmolLM2 chain_sum run)")
    p.add_argument("--dataset_path", help="parquet / jsonl / json / .pt file, a datasets folder, a Hub dataset "
                                          "name (org/name), reasoning_gym:<task>, or verifiers:<env>")
    p.add_argument("--metrics_port", type=int, help="serve OpenMetrics (Prometheus) on this port")
    p.add_argument("--output_dir", help="where checkpoints, metrics.jsonl and the reward curve go")
    p.add_argument("--set", dest="overrides", action="append", nargs="+", default=[], metavar="KEY=VALUE",
                   help="override config values, any depth (repeatable), e.g. --set actor.lr=1e-5 "
                        "trainer.dataset_kwargs.size=10")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--config-path", "-cp", dest="config_path",
                   help="Hydra's: the folder of --config-name's YAML and of the configs its defaults list names "
                        "(verl's own configs are built in)")
    p.add_argument("--config-name", "-cn", dest="config_name",
                   help="Hydra's: the config to compose (verl's ppo_trainer, ppo_megatron_trainer, sft_trainer are "
                        "built in), e.g. --config-name=ppo_megatron_trainer")
    p.add_argument("assignments", nargs="*", metavar="KEY=VALUE",
                   help="overrides as bare arguments (verl / Hydra style: +key=value, ++key=value, ~key too), "
                        "e.g. actor.lr=1e-5; options may come anywhere among them")


def resolve_config(args: argparse.Namespace) -> config_mod.Config:
    """The config file (ours or verl's layout; default: the embedded run) with the command line's
    overrides (either layout); verl keys with no meaning here are noted on stderr, one line each."""
    import sys

    from verl_fast.config import verl_config

    overrides: List[str] = [item for group in args.overrides for item in group]
    for item in args.assignments:
        if "=" not in item and not item.startswith("~"):
            raise ValueError(f"unexpected argument {item!r}: a bare argument is an override, section.key=value")
        overrides.append(item)
    if args.dataset_path:
        overrides.append(f"trainer.dataset={args.dataset_path}")
    if args.metrics_port is not None:
        overrides.append(f"trainer.metrics_port={args.metrics_port}")
    if args.output_dir:
        overrides.append(f"trainer.output_dir={args.output_dir}")
    from verl_fast.trainer import catalog

    catalog.register()
    tree = getattr(args, "tree", None)  # verl-fast sft: verl's SFT trainer
    hydra = args.config_path is not None or args.config_name is not None
    # a command line in verl's tree (or Hydra's) with no --config starts from verl's defaults, not the demo run
    demo = not (args.config or hydra or tree or verl_config.is_verl_layout(overrides))
    path = args.config or (config_mod.default_config_path() if demo else None)
    if demo:
        overrides = _off_the_demo(overrides) + overrides
    cfg, notes = verl_config.load(path, overrides, args.config_path, args.config_name, tree)
    for note in notes:
        print(f"verl-fast train: note: {note}", file=sys.stderr)
    return cfg


def _off_the_demo(overrides: List[str]) -> List[str]:
    """What of the embedded demo run a command line leaves behind when it names its own work: the
    demo's reward under an algorithm that samples nothing (SFT, DPO, KTO, ...), the demo's dataset
    options under another dataset. Put before the command line's overrides, which still win."""
    from verl_fast.algos import registry

    keys = {o.lstrip("+").partition("=")[0].strip(): o.partition("=")[2].strip() for o in overrides}
    out = []
    spec = registry.SPECS.get(keys.get("algorithm.type", ""))
    if spec is not None and not getattr(spec, "samples", True):
        out.append("reward_fn.type=auto")
    if "trainer.dataset" in keys:
        out.append("trainer.dataset_kwargs={}")
    return out


def load_checked(args: argparse.Namespace, packages: bool = True) -> config_mod.Config:
    """The resolved config, with the optional packages it needs checked (``verl_fast.extras``;
    ``packages=False``: not them); anything wrong is a ConfigError of one line."""
    import yaml

    from verl_fast import extras
    from verl_fast.algos import registry as algorithms

    try:
        cfg = resolve_config(args)
        if packages:
            extras.check(cfg, generates=algorithms.spec(cfg).samples)
    except (ValueError, ImportError, OSError, yaml.YAMLError) as e:
        lines = [" ".join(line.split()) for line in str(e).splitlines() if line.strip()]  # each problem, one line
        raise ConfigError("\n".join(lines) or type(e).__name__) from None
    return cfg


def quiet_libraries() -> None:
    """The console shows the progress bar and a line per step: the libraries' notes about their own
    set-up (vLLM's platform warnings, per-weight dtype casts, loading bars) are silenced here, before
    they are imported; their errors still show."""
    import logging
    import warnings

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # vLLM logs some notes at import, before it configures its logger from the variable above
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # "Loading weights" of from_pretrained


def run(args: argparse.Namespace) -> int:
    cfg = load_checked(args, packages=not args.print_config)
    from verl_fast.trainer import launch

    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        print("\n".join(f"# {key}: {value}" for key, value in launch.auto_settings(cfg).items()))
        return 0
    try:
        trainer, history = launch.launch(cfg, quiet_libraries)
    except launch.LaunchRefused as e:
        raise ConfigError(str(e)) from None
    if trainer.is_main and history:
        summarize(history, cfg.trainer.output_dir)
    launch.finish()
    return trainer.exit_code  # non-zero when a reward called sys.exit(n)


def summarize(history: List[Dict[str, Any]], output_dir: str) -> None:
    from verl_fast.metrics.logger import headline_key

    key = headline_key(history)  # the reward, DPO's margin, or an offline algorithm's loss
    values = [h[key] for h in history if key in h]
    k = max(1, min(5, len(values) // 2))
    first, last = sum(values[:k]) / k, sum(values[-k:]) / k
    print(f"\n{key}: first {k} steps {first:.3f} -> last {k} steps {last:.3f} ({len(values)} steps)")
    print(f"metrics: {os.path.join(output_dir, 'metrics.jsonl')}; reward curve: "
          f"{os.path.join(output_dir, 'reward_curve.png')}; checkpoints: {os.path.join(output_dir, 'checkpoints')}")
