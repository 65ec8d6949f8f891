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
