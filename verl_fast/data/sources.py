"""A dataset source as verl-format rows: a parquet / JSONL / JSON / .pt file, a folder saved by
``datasets``, a Hub dataset, a reasoning-gym task, a verifiers environment's dataset, or rows given in
Python (``load_rows``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

from verl_fast.data import readers
from verl_fast.files import hub
from verl_fast.records.prompts import PreferencePair, PromptRow


def _to_plain(x: Any) -> Any:
    """numpy / pandas / pyarrow containers from parquet back to plain Python."""
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
        x = x.tolist()
    if isinstance(x, dict):
        return {k: _to_plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_to_plain(v) for v in x]
    return x


# ``<kind>:<name>`` sources that other parts serve (``register``): kind -> rows(name, **kwargs)
NAMED: Dict[str, Callable[..., List[Dict[str, Any]]]] = {}


def register(kind: str, rows: Callable[..., List[Dict[str, Any]]]) -> None:
    """``trainer.dataset: <kind>:<name>`` loads ``rows(name, **dataset_kwargs)`` (the agents' ``verifiers:<env>``)."""
    NAMED[kind] = rows


def hub_rows(name: str, split: str = "train", **kwargs: Any) -> List[Dict[str, Any]]:
    """The rows of split ``split`` of the Hub dataset ``name`` through ``datasets.load_dataset``
    (its own cache first; ``kwargs``: ``name`` of the configuration, ``data_dir``, ...). When the Hub
    is not reachable (or ``HF_HUB_OFFLINE`` is set), the dataset's files in the HF hub cache
    (``datasets--org--name/snapshots/<rev>/``, as an earlier download left them) are loaded by
    ``datasets`` from that folder; found nowhere: ``hub.NameNotFound``."""
    import datasets

    try:
        data = datasets.load_dataset(name, split=split, **kwargs)
    except ConnectionError as unreachable:  # offline or no network: the hub cache's copy, if any
        from huggingface_hub import snapshot_download

        try:
            folder = snapshot_download(name, repo_type="dataset", local_files_only=True)
        except FileNotFoundError:  # LocalEntryNotFoundError: no snapshot of it in the cache
            raise hub.not_found("trainer.dataset", name, unreachable) from None
        data = datasets.load_dataset(folder, split=split, **kwargs)
    except datasets.exceptions.DatasetNotFoundError as e:
        raise hub.not_found("trainer.dataset", name, e) from None
    return [{k: _to_plain(v) for k, v in r.items()} for r in data]


def load_rows(source: Any, **kwargs: Any) -> List[Dict[str, Any]]:
    """verl-format rows from a parquet / JSONL / JSON file, a folder saved by ``datasets``, a Hub
    dataset name (``org/name``; kwargs go to ``datasets.load_dataset``: ``name``, ``split``, ...), a
    ``datasets.Dataset``, ``"reasoning_gym:<task>"`` (kwargs go to ``create_dataset``),
    ``"<kind>:<name>"`` of a registered kind (``"verifiers:<env>"``: a verifiers environment's dataset,
    kwargs its arguments, ``agents/verifiers_env.py``), or a list."""
    if isinstance(source, (list, tuple)) and source and all(isinstance(s, (str, Path)) for s in source):
        return [row for one in source for row in load_rows(one, **kwargs)]  # verl's list of files
    if isinstance(source, str) and source.startswith("reasoning_gym:"):
        return reasoning_gym_rows(source.split(":", 1)[1], **kwargs)
    if isinstance(source, str) and source.partition(":")[0] in NAMED and ":" in source:
        kind, _, name = source.partition(":")
        return readers.checked(NAMED[kind](name, **kwargs), source)
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()  # verl's configs write ~/data/...
        if not path.exists() and hub.is_repo_id(str(source)):
            return readers.checked(hub_rows(str(source), **kwargs), str(source))
        if not path.exists():
            raise FileNotFoundError(f"dataset {source} not found (parquet, jsonl, json, a datasets folder, "
                                    "a Hub dataset name, reasoning_gym:<task> or verifiers:<env>)")
        if path.is_dir():
            import datasets

            return readers.checked([dict(r) for r in datasets.load_from_disk(str(path))], str(path))
        if path.suffix == ".parquet":
            import pandas as pd

            readers.open_regular(path).close()  # not a FIFO or device
            return readers.checked([{k: _to_plain(v) for k, v in r.items()}
                                       for r in pd.read_parquet(path).to_dict("records")], str(path))
        if path.suffix == ".jsonl":
            return readers.read_jsonl(path)
        if path.suffix == ".json":
            return readers.read_json(path)
        if path.suffix in (".pt", ".pth"):
            readers.open_regular(path).close()
            from verl_fast.files import safe_load

            data = safe_load.load(path, [PromptRow, PreferencePair], what="a dataset")  # rows are plain data
            kinds = (dict, PromptRow, PreferencePair)  # what encode_all / build_dpo_dataset return
            if not isinstance(data, (list, tuple)) or not all(isinstance(r, kinds) for r in data):
                raise ValueError(f"{path}: expected a list of rows (dicts, PromptRow or PreferencePair), "
                                 f"got {type(data).__name__}")
            return [dict(r) if isinstance(r, dict) else r for r in data]
        raise ValueError(f"unsupported dataset file {path.name}: use .parquet, .jsonl, .json or .pt")
    if hasattr(source, "column_names") and hasattr(source, "__iter__"):  # datasets.Dataset
        return [dict(r) for r in source]
    if isinstance(source, Sequence):
        return [dict(r) for r in source]
    raise TypeError(f"unsupported dataset source {type(source).__name__}")

def reasoning_gym_rows(task: str, size: int = 1000, seed: int = 42, **task_kwargs: Any) -> List[Dict[str, Any]]:
    import dataclasses
    import difflib

    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        close = difflib.get_close_matches(task, list(DATASETS), n=3)
        raise ValueError(f"reasoning_gym has no task {task!r}" + (f"; did you mean {', '.join(close)}?" if close
                                                                  else f" ({len(DATASETS)} tasks)"))
    options = {f.name for f in dataclasses.fields(DATASETS[task][1])}
    unknown = sorted(set(task_kwargs) - options)
    if unknown:
        raise ValueError(f"dataset_kwargs.{unknown[0]}: reasoning_gym task {task} has no such option; its options: "
                         f"{', '.join(sorted(options))}")
    dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_kwargs)
    return [{"data_source": f"reasoning_gym/{task}", "prompt": [{"role": "user", "content": e["question"]}],
             "reward_model": {"ground_truth": _to_plain(e)}, "extra_info": {"index": i}}
            for i, e in enumerate(dataset)]
