"""Connecting to Ray: the cluster in RAY_ADDRESS (as inside `ray job submit`), else a local one."""

from __future__ import annotations

import logging
import os

import ray


def connect(num_cpus: int | None = None) -> None:
    """Join the cluster in RAY_ADDRESS, else start a local Ray (``num_cpus`` for tests)."""
    if ray.is_initialized():
        return
    from ray.data import DataContext

    env = {"env_vars": {"PYTHONWARNINGS": "ignore::DeprecationWarning,ignore::FutureWarning"}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env=env, log_to_driver=True)
    else:
        # with num_cpus (tests, benches) always a new local instance: a bare ray.init() would
        # join a cluster that `ray start` left running on this machine
        address = "local" if num_cpus else None
        # a local Ray's dashboard (metrics, Train page) takes ~3 s to start;
        # RAYTUNER_LOCAL_DASHBOARD=0 skips it (the tests do)
        dashboard = os.environ.get("RAYTUNER_LOCAL_DASHBOARD", "1") != "0"
        ray.init(
            address=address,
            num_cpus=num_cpus,
            include_dashboard=dashboard,
            runtime_env=env,
            logging_level=logging.WARNING,
        )
    DataContext.get_current().enable_progress_bars = False


def wait_for_resources(bundles: list[dict[str, float]], timeout_s: float, what: str) -> None:
    """Return once the cluster holds ``bundles`` (one per worker) at the same time.

    The wait is a placement group of those bundles, removed when it is ready: a pending group
    is demand an autoscaler sees, so on an autoscaling cluster (idle nodes removed, or none
    yet) the nodes are started for it; the ``available_resources`` poll this replaced asked
    for nothing and failed there after ``timeout_s``. After ``timeout_s`` seconds it fails
    naming what was asked and what exists, instead of leaving Ray to retry forever."""
    bundles = [{k: v for k, v in b.items() if v > 0} for b in bundles]
    bundles = [b for b in bundles if b]
    if not bundles:
        return
    group = ray.util.placement_group(bundles, strategy="PACK")
    try:
        if group.wait(timeout_seconds=timeout_s):
            return
    finally:
        ray.util.remove_placement_group(group)
    need = {k: sum(b.get(k, 0.0) for b in bundles) for k in {k for b in bundles for k in b}}
    total, free = ray.cluster_resources(), ray.available_resources()
    show = lambda r: ", ".join(f"{r.get(k, 0.0):g} {k}" for k in need)  # noqa: E731
    raise RuntimeError(
        f"{what} need {show(need)} at once; the cluster has {show(total)} in all and "
        f"{show(free)} free after waiting {timeout_s:g} s (scaling.resource_wait_s): "
        "lower scaling.workers / cpus_per_worker / gpus_per_worker, or add nodes"
    )
