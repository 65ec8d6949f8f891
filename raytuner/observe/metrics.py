"""raytuner's metrics on the Ray dashboard and the Prometheus endpoint (`ray start
--metrics-export-port=N`): Ray prefixes each name with ``ray_`` and counters also end in
``_total``. Every series carries the run name as its ``run`` tag.

``GAUGES`` and ``COUNTERS`` declare every metric raytuner emits: ``gauge`` and ``count`` refuse
any other name, and cluster/grafana/raytuner-dashboard.json has a panel for each (its test
compares the two)."""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge

GAUGES = {
    "raytuner_train_loss": "training loss, mean over the last log window",
    "raytuner_train_samples_per_s": "samples per second over all workers",
    "raytuner_train_step_time_s": "seconds per optimizer step",
    "raytuner_train_data_wait_fraction": "share of step time rank 0 waited for its batch",
    "raytuner_train_step": "optimizer steps done",
    "raytuner_train_tflops_per_s": "the model's TFLOP/s a training worker achieved (counted "
    "FLOPs of forward and backward, without gradient checkpointing's recompute)",
    "raytuner_train_mfu": "model FLOPs utilisation: the model's TFLOP/s over the GPU's dense "
    "bfloat16 peak (where it is known)",
    "raytuner_train_hfu": "hardware FLOPs utilisation: the TFLOP/s of everything computed, "
    "the recompute included, over the same peak",
    "raytuner_checkpoint_time_s": "seconds rank 0 spent writing and reporting a checkpoint",
    "raytuner_images_encoded_per_s": "images per second through the VAE encoder pool",
    "raytuner_validation_time_s": "seconds the last validation render took",
    "raytuner_cache_hits": "images the last preprocess found in the cache (not encoded again)",
    "raytuner_skipped_inputs": "inputs the last preprocess skipped (unreadable, too small, ...)",
}
COUNTERS = {"raytuner_images_encoded": "images encoded into the cache"}
_made: dict[str, Gauge | Counter] = {}


def prometheus_name(name: str) -> str:
    """The series name Prometheus scrapes from Ray for a declared metric."""
    return f"ray_{name}_total" if name in COUNTERS else f"ray_{name}"


def exported() -> set[str]:
    """Every series name raytuner's metrics appear under in Prometheus."""
    return {prometheus_name(name) for name in GAUGES | COUNTERS}


def _metric(name: str) -> Gauge | Counter:
    if name not in GAUGES and name not in COUNTERS:
        raise ValueError(
            f"metric {name!r} is not declared: add it to GAUGES or COUNTERS in "
            "raytuner/observe/metrics.py and a panel to cluster/grafana/raytuner-dashboard.json"
        )
    if name not in _made:
        kind, doc = (Gauge, GAUGES[name]) if name in GAUGES else (Counter, COUNTERS[name])
        _made[name] = kind(name, doc, tag_keys=("run",))
    return _made[name]


def gauge(name: str, value: float, run: str) -> None:
    _metric(name).set(float(value), tags={"run": run})


def count(name: str, n: int, run: str) -> None:
    if n > 0:  # a counter only goes up
        _metric(name).inc(n, tags={"run": run})
