"""Run metrics, one dict per step, to the sinks named in ``trainer.loggers``: ``jsonl``
(``metrics.jsonl``), ``console`` (a progress bar and a line per step), ``tensorboard``
(``<output_dir>/tensorboard``), ``wandb``; plus an OpenMetrics (Prometheus) endpoint when
``trainer.metrics_port`` is set, and a PNG of the reward curve at the end. A record without
``time/step`` is a validation before training (step 0). Sample generations
(``trainer.log_generations``: prompt, response, reward) go to ``generations.jsonl``, TensorBoard
text and a wandb table."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from verl_fast import config
from verl_fast.metrics import http_server as metrics_http
from verl_fast.files import run_files

# Step-metric keys with the names dashboards know; every other numeric key is exported as a gauge
# named verl_<key> (characters outside [a-zA-Z0-9_] become _).
GAUGES = {
    "reward/mean": ("verl_reward_mean", "mean sequence reward of the step"),
    "actor/kl": ("verl_kl", "mean KL(actor || reference) over response tokens"),
    "actor/entropy": ("verl_entropy", "mean entropy of the actor over response tokens"),
    "actor/clipfrac": ("verl_clip_fraction", "fraction of response tokens whose PPO ratio was clipped"),
    "rollout/prefix_cache_hit_rate": ("verl_gpu_cache_hit_ratio", "rollout engine prefix-cache hit ratio"),
    "rollout/kv_cache_usage_peak": ("verl_kv_cache_usage_ratio", "rollout engine KV-cache usage at its busiest step"),
}
# Latencies (seconds) as histograms; other ``time/*`` keys get verl_time_<key>_seconds.
HISTOGRAMS = {
    "time/generation": ("verl_actor_generation_latency_seconds", "rollout generation latency"),
    "time/step": ("verl_training_step_duration_seconds", "training step duration"),
    "time/weight_sync": ("verl_weight_sync_duration_seconds", "actor -> rollout engine weight sync"),
}
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
LOGGERS = {"console": None, "jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb"}  # name -> package
config.LOGGERS.register(*LOGGERS)


def sanitize(key: str) -> str:
    return "verl_" + re.sub(r"[^a-zA-Z0-9_]", "_", key).strip("_").lower()


def numeric(metrics: Dict[str, Any]) -> Dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


def check_loggers(loggers: Sequence[str]) -> None:
    """Raises naming the package to install for each logger that needs a missing one."""
    for name in loggers:
        package = LOGGERS.get(name)
        if package and importlib.util.find_spec(package) is None:
            raise ImportError(f"trainer.loggers has {name}, which needs the {package} package: pip install "
                              f"{package} (or remove {name} from trainer.loggers)")


class MetricsServer:
    """Every numeric step metric as a gauge, latencies also as histograms, in prometheus_client's
    exposition, served on ``host:port`` (port 0: any free port, see ``.port``) from a bounded pool of
    threads that closes idle connections (``metrics_http``; ``limits``: its workers, max_open,
    idle_s, request_timeout_s)."""

    def __init__(self, port: int, host: str = "127.0.0.1", **limits: Any):
        try:
            import prometheus_client as prom
        except ImportError as e:
            raise ImportError("metrics_port needs prometheus-client: pip install prometheus-client") from e
        self.prom = prom
        self.registry = prom.CollectorRegistry()
        self.histograms = {key: prom.Histogram(name, doc, buckets=BUCKETS, registry=self.registry)
                           for key, (name, doc) in HISTOGRAMS.items()}
        self.gauges = {key: prom.Gauge(name, doc, registry=self.registry) for key, (name, doc) in GAUGES.items()}
        self.names = {name for name, _ in [*GAUGES.values(), *HISTOGRAMS.values()]}
        self.server, self.thread = metrics_http.serve(prom.make_wsgi_app(self.registry), host, port, **limits)
        self.port = self.server.server_port

    def _metric(self, table: Dict[str, Any], key: str, name: str, kind: str) -> Optional[Any]:
        if key not in table:
            if name in self.names:  # two keys that sanitise to one name: the first keeps it
                table[key] = None
            else:
                self.names.add(name)
                cls = self.prom.Histogram if kind == "histogram" else self.prom.Gauge
                extra = {"buckets": BUCKETS} if kind == "histogram" else {}
                table[key] = cls(name, f"step metric {key}", registry=self.registry, **extra)
        return table[key]

    def observe(self, metrics: Dict[str, Any]) -> None:
        for key, value in numeric(metrics).items():
            gauge = self._metric(self.gauges, key, sanitize(key), "gauge")
            if gauge is not None:
                gauge.set(value)
            if key.startswith("time/") and math.isfinite(value):
                hist = self._metric(self.histograms, key, sanitize(key) + "_seconds", "histogram")
                if hist is not None:
                    hist.observe(value)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def step_summary(metrics: Dict[str, Any]) -> str:
    """The progress bar's short account of a step: the two big phases and throughput."""
    parts = []
    for key, label in (("time/generation", "gen"), ("time/update_actor", "update")):
        if key in metrics:
            parts.append(f"{label} {metrics[key]:.1f}s")
    if "perf/tokens_per_s_per_gpu" in metrics:
        parts.append(f"{metrics['perf/tokens_per_s_per_gpu']:.0f} tok/s/gpu")
    if "perf/mfu_update" in metrics:
        parts.append(f"mfu {100 * metrics['perf/mfu_update']:.0f}%")
    if "perf/peak_memory_gib" in metrics:
        parts.append(f"mem {metrics['perf/peak_memory_gib']:.1f}GiB")
    return "  ".join(parts)


# a run's headline figure, the first of these its steps log: the reward, DPO's margin, an offline algorithm's loss
HEADLINES = ("reward/mean", "dpo/reward_margin", "sft/loss", "kto/loss", "orpo/loss", "simpo/loss", "cpo/loss")


def headline_key(history: List[Dict[str, Any]]) -> str:
    """The key of ``HEADLINES`` that ``history``'s records log (reward/mean when none)."""
    return next((k for k in HEADLINES if any(k in m for m in history)), "reward/mean")


SAMPLE_COLUMNS = ("data_source", "prompt", "response", "reward")  # a logged generation's fields


def generations_markdown(samples: List[Dict[str, Any]]) -> str:
    """Samples as a markdown table (TensorBoard renders its text so)."""
    def cell(v: Any) -> str:
        text = f"{v:.4g}" if isinstance(v, float) else str(v)
        return text.replace("|", "\\|").replace("\n", "<br>")

    rows = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
    rows += ["| " + " | ".join(cell(s[c]) for c in SAMPLE_COLUMNS) + " |" for s in samples]
    return "\n".join(rows)


class _Console:
    def __init__(self, total_steps: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True)

    def resume(self, history: List[Dict[str, Any]]) -> None:
        self.bar.update(sum(1 for m in history if "time/step" in m))

    def log(self, m: Dict[str, Any]) -> None:
        nan = float("nan")
        val = "val loss" if "val/loss" in m else "val reward"
        val_value = m.get("val/loss", m.get("val/reward/mean", nan))
        if "time/step" not in m:  # the validation before training
            self.bar.write(f"step {m['step']:4d}  {val} {val_value:.3f}")
            return
        key = headline_key([m])
        label = "reward" if key == "reward/mean" else key
        self.bar.update(1)
        self.bar.set_postfix({label: f"{m.get(key, nan):.3f}", "loss": f"{m.get('actor/pg_loss', nan):.3f}"}
                             if key == "reward/mean" else {label: f"{m.get(key, nan):.3f}"})
        self.bar.write(f"step {m['step']:4d}  {label} {m.get(key, nan):.3f}  "
                       f"response_len {m.get('response/length', nan):.1f}  step_time {m.get('time/step', nan):.1f}s  "
                       f"{step_summary(m)}" + (f"  {val} {val_value:.3f}" if val_value == val_value else ""))

    def generations(self, step: int, kind: str, samples: List[Dict[str, Any]]) -> None:
        pass

    def close(self) -> None:
        self.bar.close()


class _JSONL:
    def __init__(self, path: Path):
        self.path = path
        self.samples = path.with_name("generations.jsonl")

    def resume(self, history: List[Dict[str, Any]]) -> None:
        """The file becomes the restored history: rows of steps after the checkpoint (which will run
        again) go away, from generations.jsonl too."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(m) + "\n" for m in history).encode()
        run_files.replace_file(self.path, lambda f: f.write(text))  # a link at the name is replaced, not followed
        last = history[-1]["step"] if history else -1
        kept = []
        if os.path.isfile(self.samples):
            kept = [line for line in self.samples.read_text().splitlines(keepends=True)
                    if line.strip() and json.loads(line)["step"] <= last]
        if kept or os.path.lexists(self.samples):
            data = "".join(kept).encode()
            run_files.replace_file(self.samples, lambda f: f.write(data))

    def log(self, m: Dict[str, Any]) -> None:
        with run_files.open_append(self.path) as f:
            f.write(json.dumps(m) + "\n")

    def generations(self, step: int, kind: str, samples: List[Dict[str, Any]]) -> None:
        with run_files.open_append(self.samples) as f:
            f.write("".join(json.dumps({"step": step, "kind": kind, **s}) + "\n" for s in samples))

    def close(self) -> None:
        pass


class _TensorBoard:
    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.folder, self.writer = folder, None
        self.make = SummaryWriter

    def resume(self, history: List[Dict[str, Any]]) -> None:
        # purge_step drops events of steps after the checkpoint that an earlier attempt wrote
        self.writer = self.make(str(self.folder), purge_step=history[-1]["step"] + 1 if history else None)

    def log(self, m: Dict[str, Any]) -> None:
        if self.writer is None:
            self.resume([])
        for k, v in numeric(m).items():
            if k != "step":
                self.writer.add_scalar(k, v, global_step=int(m["step"]))
        self.writer.flush()

    def generations(self, step: int, kind: str, samples: List[Dict[str, Any]]) -> None:
        if self.writer is None:
            self.resume([])
        self.writer.add_text(f"generations/{kind}", generations_markdown(samples), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class _WandB:
    def __init__(self, folder: Path, run_config: Optional[Dict[str, Any]], project: str, name: Optional[str]):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, name=name or folder.name, dir=str(folder), config=run_config or {})

    def resume(self, history: List[Dict[str, Any]]) -> None:
        pass

    def log(self, m: Dict[str, Any]) -> None:
        self.run.log(numeric(m), step=int(m["step"]))

    def generations(self, step: int, kind: str, samples: List[Dict[str, Any]]) -> None:
        table = self.wandb.Table(columns=list(SAMPLE_COLUMNS), data=[[s[c] for c in SAMPLE_COLUMNS] for s in samples])
        self.run.log({f"generations/{kind}": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    def __init__(self, output_dir: str, total_steps: int, progress_bar: bool = True,
                 port: Optional[int] = None, enabled: bool = True, host: str = "127.0.0.1",
                 loggers: Sequence[str] = ("console", "jsonl"), run_config: Optional[Dict[str, Any]] = None,
                 project: str = "verl_fast", run_name: Optional[str] = None):
        """``project`` / ``run_name``: the wandb run's (``run_name`` None: output_dir's folder name)."""
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.history: List[Dict[str, Any]] = []
        self.sinks: List[Any] = []
        self.server = None
        if not enabled:
            return
        check_loggers(loggers)
        if "jsonl" in loggers:
            self.sinks.append(_JSONL(self.path))
        if "console" in loggers and progress_bar:
            self.sinks.append(_Console(total_steps))
        if "tensorboard" in loggers:
            self.sinks.append(_TensorBoard(Path(output_dir) / "tensorboard"))
        if "wandb" in loggers:
            self.sinks.append(_WandB(Path(output_dir), run_config, project, run_name))
        self.server = MetricsServer(port, host) if port is not None else None

    def resume(self, history: List[Dict[str, Any]]) -> None:
        """Starts from ``history`` (restored from a checkpoint; empty for a new run)."""
        self.history = list(history)
        for sink in self.sinks:
            sink.resume(self.history)

    def log(self, metrics: Dict[str, Any]) -> None:
        self.history.append(metrics)
        for sink in self.sinks:
            sink.log(metrics)
        if self.server is not None:
            self.server.observe(metrics)

    def log_generations(self, step: int, kind: str, samples: List[Dict[str, Any]]) -> None:
        """``samples`` (dicts of SAMPLE_COLUMNS) of step ``step``'s ``kind`` (train, val) to every sink."""
        if samples:
            for sink in self.sinks:
                sink.generations(step, kind, samples)

    def plot(self, path: Optional[Path] = None) -> Optional[Path]:
        """Reward per step (and its running mean) as a PNG beside the JSONL."""
        if not self.enabled or not self.history:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        key = headline_key(self.history)
        steps = [m["step"] for m in self.history if key in m]
        values = [m[key] for m in self.history if key in m]
        window = max(1, len(values) // 5)
        smooth = [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
                  for i in range(len(values))]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(steps, values, marker="o", ms=3, lw=1, label=key)
        ax.plot(steps, smooth, lw=2, label=f"running mean ({window})")
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = path or self.path.with_name("reward_curve.png")
        run_files.replace_file(path, lambda f: fig.savefig(f, format="png", dpi=120))
        plt.close(fig)
        return path

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        if self.server is not None:
            self.server.close()
