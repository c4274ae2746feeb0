"""Run metrics: a JSONL file, a console progress bar, an OpenMetrics (Prometheus) endpoint, and a
PNG of the reward curve at the end."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional

from verl_fast.trainer.perf import summary as perf_summary

# Gauges exported when present in a step's metrics: name in the step dict -> Prometheus name.
GAUGES = {
    "reward/mean": ("verl_reward_mean", "mean sequence reward of the step"),
    "actor/kl": ("verl_kl", "mean KL(actor || reference) over response tokens"),
    "actor/entropy": ("verl_entropy", "mean entropy of the actor over response tokens"),
    "actor/clipfrac": ("verl_clip_fraction", "fraction of response tokens whose PPO ratio was clipped"),
    "rollout/prefix_cache_hit_rate": ("verl_gpu_cache_hit_ratio", "rollout engine prefix-cache hit ratio"),
    "rollout/kv_cache_usage_peak": ("verl_kv_cache_usage_ratio", "rollout engine KV-cache usage at its busiest step"),
}


class MetricsServer:
    """``verl_actor_generation_latency_seconds`` (histogram), ``verl_training_step_duration_seconds``
    (histogram) and the GAUGES above, served on ``port`` by prometheus_client."""

    def __init__(self, port: int):
        try:
            import prometheus_client as prom
        except ImportError as e:
            raise ImportError("metrics_port needs prometheus-client: pip install prometheus-client") from e
        self.registry = prom.CollectorRegistry()
        buckets = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
        self.generation = prom.Histogram("verl_actor_generation_latency_seconds", "rollout generation latency",
                                         buckets=buckets, registry=self.registry)
        self.step = prom.Histogram("verl_training_step_duration_seconds", "training step duration",
                                   buckets=buckets, registry=self.registry)
        self.gauges = {key: prom.Gauge(name, doc, registry=self.registry) for key, (name, doc) in GAUGES.items()}
        self.server, self.thread = prom.start_http_server(port, registry=self.registry)
        self.port = self.server.server_port

    def observe(self, metrics: Dict[str, float]) -> None:
        if "time/generation" in metrics:
            self.generation.observe(metrics["time/generation"])
        if "time/step" in metrics:
            self.step.observe(metrics["time/step"])
        for key, gauge in self.gauges.items():
            if key in metrics and math.isfinite(metrics[key]):
                gauge.set(metrics[key])

    def close(self) -> None:
        self.server.shutdown()


class MetricsLogger:
    def __init__(self, output_dir: str, total_steps: int, progress_bar: bool = True,
                 port: Optional[int] = None, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.history: List[Dict[str, Any]] = []
        self.server = MetricsServer(port) if (port is not None and enabled) else None
        self.bar = None
        if progress_bar and enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True)

    def resume(self, history: List[Dict[str, Any]]) -> None:
        self.history = list(history)
        if self.bar is not None and history:
            self.bar.update(len(history))

    def log(self, metrics: Dict[str, Any]) -> None:
        self.history.append(metrics)
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.server is not None:
            self.server.observe(metrics)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
                                 loss=f"{metrics.get('actor/pg_loss', float('nan')):.3f}")
            self.bar.write(f"step {metrics['step']:4d}  reward {metrics.get('reward/mean', float('nan')):.3f}  "
                           f"response_len {metrics.get('response/length', float('nan')):.1f}  "
                           f"step_time {metrics.get('time/step', float('nan')):.1f}s  {perf_summary(metrics)}")

    def plot(self, path: Optional[Path] = None) -> Optional[Path]:
        """Reward per step (and its running mean) as a PNG beside the JSONL."""
        if not self.enabled or not self.history:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        key = "reward/mean" if "reward/mean" in self.history[0] else "dpo/reward_margin"
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
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.server is not None:
            self.server.close()
