"""Connecting to Ray: the cluster in RAY_ADDRESS (as inside `ray job submit`), else a local one;
and what a job's actors and workers may ask of that cluster."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass

import ray

from raytuner import quiet

log = logging.getLogger(__name__)

# every worker process of the job runs it when it starts (Ray's runtime_env hook, by name)
SETUP_HOOK = "raytuner.runtime.setup_worker"
# set in the workers of a local Ray started without its dashboard: no state API there
NO_STATE_API = "RAYTUNER_NO_STATE_API"


def connect(num_cpus: int | None = None) -> None:
    """Join the cluster in RAY_ADDRESS, else start a local Ray (``num_cpus`` for tests)."""
    global _state_api, _local
    if ray.is_initialized():
        return
    from ray.data import DataContext

    env_vars = {"PYTHONWARNINGS": "ignore::DeprecationWarning,ignore::FutureWarning"}
    env: dict = {"env_vars": env_vars}
    if "worker_process_setup_hook" not in os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", ""):
        env["worker_process_setup_hook"] = SETUP_HOOK  # a job's own hook wins (no conflict)
    started = time.monotonic()
    if os.environ.get("RAY_ADDRESS"):
        log.info("joining the Ray cluster at %s", os.environ["RAY_ADDRESS"])
        with _own_sigterm_handler():
            ray.init(runtime_env=env, log_to_driver=True)
        _state_api, _local = True, False
    else:
        # always a Ray of its own: a bare ray.init() joins the cluster `ray start` last left
        # running on this machine (its ray_current_cluster), whoever started it: another
        # user's, another command's, which may end while this one runs (RAY_ADDRESS joins one)
        address = "local"
        # a local Ray's dashboard (metrics, Train page) takes ~3 s to start;
        # RAYTUNER_LOCAL_DASHBOARD=0 skips it (the tests do)
        dashboard = os.environ.get("RAYTUNER_LOCAL_DASHBOARD", "1") != "0"
        port = None
        if not dashboard:
            # Without it Ray 2.60 still runs a dashboard process, with no HTTP server and no
            # state API, and advertises its default port 8265, where another Ray's dashboard
            # may answer: a state-API query of this Ray's (Ray Train's PlacementGroupCleaner
            # asks whether the run's controller lives) would be answered about another
            # cluster. A port of its own is advertised instead, where every query fails; and
            # the cleaner is not started here (``trainer._create_default_callbacks``).
            port, env_vars[NO_STATE_API] = _free_port(), "1"
        log.info("starting a local Ray%s", "" if dashboard else " (no dashboard)")
        with _own_sigterm_handler():
            ray.init(
                address=address,
                num_cpus=num_cpus,
                include_dashboard=dashboard,
                dashboard_port=port,
                runtime_env=env,
                logging_level=logging.WARNING,
            )
        _state_api, _local = dashboard, True
    cpus = ray.cluster_resources().get("CPU", 0)
    log.info("Ray ready in %.1f s (%g CPUs)", time.monotonic() - started, cpus)
    context = DataContext.get_current()
    # one progress line instead of Ray Data's per-operator bars (preprocess/progress.py), and
    # none of its "Starting execution" / "Execution plan" lines per stream
    context.enable_progress_bars = False
    context.print_on_execution_start = False


# whether the connected Ray answers Ray's state API (a local Ray without its dashboard does not)
_state_api = True
# whether this process started the Ray it is connected to: one node, which nothing drains
_local = False


def is_local() -> bool:
    """Whether the Ray this process connected to is a local one it started (not a cluster)."""
    return _local


def has_state_api() -> bool:
    """Whether the Ray this process connected to serves Ray's state API (its dashboard): a
    local Ray started with ``RAYTUNER_LOCAL_DASHBOARD=0`` does not, so Ray Train's state
    tracking (the dashboard's Train page) has nothing to show and must stay off there: its
    state actor asks the state API every 30 s whether each run's controller lives and prints a
    60-line traceback each time it cannot."""
    return _state_api


@contextlib.contextmanager
def _own_sigterm_handler():
    """Around ``ray.init``: the SIGTERM handler this process had (raytuner's CLI: SIGTERM, what
    `ray job stop` sends, stops a run as Ctrl-C does) is put back after it. ``ray.init``
    replaces it with its own (``sys.exit(15)``), and Ray's core worker then puts the failure
    signal handler of its C++ logging in front, which prints a 6-line "SIGTERM received ...
    PC: @" dump before it. A process without a handler of its own keeps Ray's."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if callable(before):
            signal.signal(signal.SIGTERM, before)


# what Ray's job supervisor waits after its SIGTERM before it SIGKILLs a stopped job's driver,
# unless RAY_JOB_STOP_WAIT_TIME_S is set (JobSupervisor.DEFAULT_RAY_JOB_STOP_WAIT_TIME_S)
RAY_JOB_STOP_WAIT_S = 3


def job_stop_wait_s() -> float | None:
    """How long `ray job stop` lets this driver stop before Ray SIGKILLs it: the
    ``RAY_JOB_STOP_WAIT_TIME_S`` of the job's environment (the job supervisor, which sends the
    signals, reads it from its own environment, the job's runtime env ``env_vars`` included,
    and hands the driver a copy), else Ray's default of 3 s. None outside a `ray job submit`
    driver."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:
        return None
    try:  # whole seconds: Ray reads it with int()
        return float(int(os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", RAY_JOB_STOP_WAIT_S)))
    except ValueError:  # Ray's supervisor fails on it too: nothing better is known
        return RAY_JOB_STOP_WAIT_S


def kill_started_processes() -> None:
    """SIGKILL every process this one started that still runs (a local Ray's GCS, raylet,
    agents and workers), for an exit that cannot wait for ``ray.shutdown``: Ray's agents (its
    dashboard agent among them) outlived a driver that left at once (``os._exit``) by more
    than 30 s. The stderr filter (``quiet.stderr_filtered``) is left to pass on the last lines:
    it ends when this process's stderr closes."""
    import psutil

    from raytuner import quiet

    for child in psutil.Process().children(recursive=True):
        if child.pid in quiet.FILTERS:
            continue
        with contextlib.suppress(psutil.Error):
            child.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_worker() -> None:
    """Run by every worker process of the job as it starts (``SETUP_HOOK``): raytuner's log
    filters (``quiet``), and the worker's own cluster in RAY_ADDRESS. Ray's state API, which
    Ray Train's PlacementGroupCleaner actor asks every second whether the run's controller is
    alive, finds its cluster from RAY_ADDRESS, else from the last `ray start` on the machine,
    else by looking for Ray processes on it: with a second Ray there (another user's, another
    test's) it raised "Found multiple active Ray instances", a ~60-line traceback, or asked
    the other cluster."""
    quiet.install(no_state_api=os.environ.get(NO_STATE_API) == "1")
    os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)


# ---- what the cluster can hold ------------------------------------------------------------


@dataclass(frozen=True)
class NodeType:
    """A kind of node an autoscaler may add: its resources, at most ``max_count`` (-1: no
    limit) nodes of it."""

    name: str
    resources: dict[str, float]
    max_count: int


@dataclass(frozen=True)
class Cluster:
    """The nodes alive now (their total resources), and what may be added to them:
    ``autoscaler`` is ``"none"`` (a Ray this process started, or one whose monitor runs
    without an autoscaling config), ``"types"`` (an autoscaler that published its node types,
    ``types``), ``"v2"`` (Ray's autoscaler v2: its node types are not published in Ray 2.60,
    but it reports the requests it can never place) or ``"unknown"`` (autoscaler v1, which
    publishes neither)."""

    nodes: tuple[dict[str, float], ...]
    autoscaler: str
    types: tuple[NodeType, ...] = ()

    def never(self, bundles: list[dict[str, float]]) -> list[str]:
        """Why these bundles can never be held at once, one reason per resource short
        (empty: they may be). Only certain shortfalls: a bundle no node (or node type) is large
        enough for, or more of a resource in all than the cluster has (or can grow to)."""
        if self.autoscaler in ("v2", "unknown"):  # what it may add is not known here
            return []
        shapes = list(self.nodes) + [t.resources for t in self.types if t.max_count != 0]
        largest = lambda k: max((s.get(k, 0.0) for s in shapes), default=0.0)  # noqa: E731
        where = "node or type" if self.types else "node"
        reasons = []
        for bundle in sorted({_key(b) for b in bundles}):
            need = dict(bundle)
            if any(all(v <= s.get(k, 0.0) + 1e-9 for k, v in need.items()) for s in shapes):
                continue
            short = [k for k, v in need.items() if v > largest(k) + 1e-9]
            for k in short:
                most = largest(k)
                reasons.append(f"{k}: one needs {need[k]:g}, the largest {where} has {most:g}")
            if not short:
                reasons.append(f"no {where} holds {_show(need)} at once")
        total, most = _sum(bundles), self.most()
        for k, v in total.items():
            if v > most.get(k, 0.0) + 1e-9 and not any(r.startswith(f"{k}:") for r in reasons):
                reasons.append(f"{k}: {v:g} in all, the cluster {self._grows()} {most.get(k, 0):g}")
        return reasons

    def most(self) -> dict[str, float]:
        """The most of each resource the cluster can ever have at once."""
        out = _sum(list(self.nodes))
        for t in self.types:
            for k, v in t.resources.items():
                out[k] = out.get(k, 0.0) + (math.inf if t.max_count < 0 else v * t.max_count)
        return out

    def _grows(self) -> str:
        return "can grow to" if any(t.max_count != 0 for t in self.types) else "has"

    def describe(self, keys) -> str:
        """The nodes (and what an autoscaler may add), in the resources ``keys``."""
        n, total = len(self.nodes), _sum(list(self.nodes))
        text = f"the cluster has {_show(total, keys)} in all ({n} node{'s' * (n != 1)})"
        if self.autoscaler == "none":
            return text + " and no autoscaler"
        if self.autoscaler == "types":
            added = [
                f"{'any number' if t.max_count < 0 else f'up to {t.max_count}'} x "
                f"{t.name} ({_show(t.resources, keys)})"
                for t in self.types
                if t.max_count != 0
            ]
            return text + (f"; its autoscaler may add {', '.join(added)}" if added else "")
        return text + " and an autoscaler"


def cluster() -> Cluster:
    """What the connected cluster holds now and what an autoscaler may add to it."""
    nodes = tuple(dict(n["Resources"]) for n in ray.nodes() if n.get("Alive"))
    node = getattr(ray._private.worker, "_global_node", None)
    if node is not None and node.head:  # this process's ray.init started it: no autoscaler
        return Cluster(nodes, "none")
    try:
        return Cluster(nodes, *_autoscaler())
    except Exception as e:  # noqa: BLE001 - what Ray publishes here is private; never fatal
        log.debug("cannot read the autoscaler's state: %r", e)
        return Cluster(nodes, "unknown")


def _autoscaler() -> tuple[str, tuple[NodeType, ...]]:
    """What Ray 2.60 publishes of an autoscaler, in the GCS:

    - the cluster config (``ray._private.state.state.get_cluster_config()``: node group
      configs, each with its resources and max count; what Ray Train's own check of a worker
      group and Ray Data's autoscaler read), written by autoscalers that report it;
    - the autoscaler v2 flag (``is_autoscaler_v2``);
    - autoscaler v1's status (``__autoscaling_status`` in the KV, what `ray status` prints):
      its node types by name only. A monitor without an autoscaling config (a local Ray, a
      `ray start` cluster with no ``--autoscaling-config``) names each node ``node_<id>``."""
    import ray._private.state
    from ray._private import ray_constants
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    # this process's own GCS client (Ray's module-level one can be reset by other code in it)
    gcs = ray._private.worker.global_worker.gcs_client
    config = ray._private.state.state.get_cluster_config()
    if config is not None and config.node_group_configs:
        types = tuple(
            NodeType(g.name, {k: float(v) for k, v in g.resources.items()}, g.max_count)
            for g in config.node_group_configs
        )
        return "types", types
    if is_autoscaler_v2(fetch_from_server=True, gcs_client=gcs):
        return "v2", ()
    status = gcs.internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS.encode(), None)
    if status:
        mapping = json.loads(status).get("autoscaler_report", {}).get("node_type_mapping") or {}
        if mapping and all(kind == f"node_{node}" for node, kind in mapping.items()):
            return "none", ()
    return "unknown", ()


def refused(reply: bytes, group_id: str) -> bool:
    """Whether autoscaler v2's state (a serialized ``GetClusterStatusReply``) counts the
    placement group ``group_id`` (hex) among the requests it can never place."""
    from ray.core.generated.autoscaler_pb2 import GetClusterStatusReply

    state = GetClusterStatusReply.FromString(reply).autoscaling_state
    return any(r.details.startswith(group_id) for r in state.infeasible_gang_resource_requests)


def _refused_by_autoscaler(group) -> bool:
    try:
        reply = ray._private.worker.global_worker.gcs_client.get_cluster_status(timeout_s=5)
        return refused(reply, group.id.hex())
    except Exception as e:  # noqa: BLE001 - a missing verdict only means waiting longer
        log.debug("no autoscaler state: %r", e)
        return False


def _key(bundle: dict[str, float]) -> tuple:
    return tuple(sorted(bundle.items()))


def _sum(bundles: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _show(resources: dict[str, float], keys=None) -> str:
    keys = list(resources) if keys is None else keys
    return ", ".join(f"{resources.get(k, 0.0):g} {k}" for k in keys)


def _shapes(bundles: list[dict[str, float]], keys) -> str:
    counts = Counter(_key(b) for b in bundles)
    return " + ".join(f"{n} x ({_show(dict(b), keys)})" for b, n in counts.items())


def wait_for_resources(
    bundles: list[dict[str, float]],
    timeout_s: float,
    what: str,
    setting: str = "scaling.resource_wait_s",
    lower: str = "scaling.workers / cpus_per_worker / gpus_per_worker",
) -> None:
    """Return once the cluster holds ``bundles`` (one per worker or actor) at the same time.

    What the cluster can never hold fails at once, naming the resource, what was asked and
    what the cluster has and can add (``Cluster.never``): no node or node type an autoscaler
    may add is large enough for a bundle, or the cluster cannot grow to the sum. Otherwise the
    wait is a placement group of those bundles, removed when it is ready: a pending group is
    demand an autoscaler sees, so on an autoscaling cluster the nodes are started for it.
    After ``timeout_s`` seconds (``setting``), or as soon as autoscaler v2 reports that it can
    never place the group, it fails naming what was asked and what exists, instead of leaving
    Ray to retry forever; ``lower``: the settings that ask for less."""
    bundles = [{k: v for k, v in b.items() if v > 0} for b in bundles]
    bundles = [b for b in bundles if b]
    if not bundles:
        return
    need = _sum(bundles)
    keys = sorted(need)
    found = cluster()
    if reasons := found.never(bundles):
        raise RuntimeError(
            f"{what} need {_show(need, keys)} at once ({_shapes(bundles, keys)}); "
            f"{found.describe(keys)}: it can never hold them ({'; '.join(reasons)}). "
            f"Lower {lower}, or add nodes (nothing to wait {setting} for)"
        )
    group = ray.util.placement_group(bundles, strategy="PACK")
    start = time.monotonic()
    deadline, said = start + timeout_s, start
    try:
        while True:
            step = min(5.0, max(0.0, deadline - time.monotonic()))
            if group.wait(timeout_seconds=step):
                return
            if time.monotonic() - said >= 5.0:  # a line every ~10 s while it waits
                waited, said = time.monotonic() - start, time.monotonic() + 5.0
                log.info(
                    "waiting for %s (%s at once): %.0f s of %g s (%s)",
                    *(what, _show(need, keys), waited, timeout_s, setting),
                )
            if found.autoscaler == "v2" and _refused_by_autoscaler(group):
                raise RuntimeError(
                    f"{what} need {_show(need, keys)} at once ({_shapes(bundles, keys)}); "
                    f"{found.describe(keys)}, which reports it can never place them. "
                    f"Lower {lower}, or add a node type that holds them"
                )
            if time.monotonic() >= deadline:
                break
    finally:
        ray.util.remove_placement_group(group)
    total, free = ray.cluster_resources(), ray.available_resources()
    raise RuntimeError(
        f"{what} need {_show(need, keys)} at once; the cluster has {_show(total, keys)} in all "
        f"and {_show(free, keys)} free after waiting {timeout_s:g} s ({setting}): "
        f"lower {lower}, or add nodes"
    )
