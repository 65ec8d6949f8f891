"""Weights & Biases for a run (``[tracking]``), and the mirror that carries files a writer needs a
local disk for (TensorBoard event files, offline W&B runs) to a remote run folder.

One raytuner run is one W&B run: its id is kept in ``<run>/wandb_run_id``, so every attempt of
the run (a restart, a resubmitted job) logs into it, and the validation actor logs its grids
there too. Online, rank 0 and the actor are two writers of W&B's ``shared`` mode; offline, each
writes its own ``<run>/wandb/offline-run-*-<id>`` folder and ``wandb sync`` joins them into the
one run. Steps are the custom x-axes ``train/step`` and ``validation/step`` (shared mode takes
no ``step=``; a resumed run logs again the steps after its checkpoint, which W&B's own step
would drop).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import secrets
import shutil
import tempfile
import time

from raytuner import storage
from raytuner.checkpoint.layout import WANDB, WANDB_RUN_ID
from raytuner.config import TrackingConfig

log = logging.getLogger("raytuner.train")
INSTALL = "pip install 'raytuner[tracking]'"


def missing() -> bool:
    """Whether the wandb package is not installed (``tracking.wandb`` cannot run)."""
    return importlib.util.find_spec("wandb") is None


def is_remote(run_dir: str) -> bool:
    return "://" in run_dir


class Mirror:
    """A local folder copied into a folder on the run's filesystem: each file again only when
    its size or modification time changed since its last copy; ``push`` at most every
    ``every_s`` seconds unless forced."""

    def __init__(self, local: str, remote: str, every_s: float = 0.0) -> None:
        self.local, self.remote_uri, self.every_s = local, remote, every_s
        self.fs, self.remote = storage.resolve(remote)
        self.sent: dict[str, tuple[int, int]] = {}
        self.pushed_at = float("-inf")

    def push(self, force: bool = False) -> int:
        """Copy the changed files; return how many were copied."""
        if not force and time.monotonic() - self.pushed_at < self.every_s:
            return 0
        self.pushed_at, copied = time.monotonic(), 0
        for root, _, names in os.walk(self.local):
            for name in sorted(names):
                path = os.path.join(root, name)
                if os.path.islink(path):
                    continue  # W&B's latest-run link: the folder it names is copied anyway
                info = os.stat(path)  # before the copy: a write during it is copied next time
                stamp = (info.st_size, info.st_mtime_ns)
                relative = os.path.relpath(path, self.local).replace(os.sep, "/")
                if self.sent.get(relative) == stamp:
                    continue
                try:
                    storage.copy_file(path, self.fs, storage.join(self.remote, relative))
                except FileNotFoundError:
                    continue  # a temporary file its writer removed meanwhile
                self.sent[relative] = stamp
                copied += 1
        return copied

    def close(self) -> None:
        """The last push, then the local folder goes."""
        self.push(force=True)
        shutil.rmtree(self.local, ignore_errors=True)


def local_folder(run_dir: str, name: str, every_s: float = 0.0) -> tuple[str, Mirror | None]:
    """Where a writer that needs a local disk writes ``<run>/<name>``: that folder itself for a
    local run; for an ``s3://`` or ``gs://`` run a temporary folder and its mirror there."""
    if not is_remote(run_dir):
        folder = os.path.join(storage.absolute(run_dir), name)
        os.makedirs(folder, exist_ok=True)
        return folder, None
    local = tempfile.mkdtemp(prefix=f"raytuner-{name}-")
    return local, Mirror(local, storage.join(run_dir, name), every_s)


def run_id(run_dir: str) -> str:
    """The run's W&B id from ``<run>/wandb_run_id``, made there (random) on first use: a
    resumed run logs into the same W&B run, a new run of the same name into a new one."""
    fs, path = storage.resolve(storage.join(storage.absolute(run_dir), WANDB_RUN_ID))
    if storage.exists(fs, path):
        return storage.read_bytes(fs, path).decode().strip()
    made = secrets.token_hex(6)
    storage.write_atomic(fs, path, made.encode())
    return made


class WandbRun:
    """The run's W&B run in this process: rank 0's (``primary``: it sets the config, the
    resolved job, and finishes the run) or the validation actor's (a second writer)."""

    def __init__(self, t: TrackingConfig, run_dir: str, job: dict | None, primary: bool) -> None:
        import wandb

        offline = t.wandb_mode == "offline"
        self.temporary = is_remote(run_dir)
        if self.temporary:
            self.root = tempfile.mkdtemp(prefix="raytuner-wandb-")  # W&B writes <root>/wandb
            remote = storage.join(run_dir, WANDB)
            self.mirror = Mirror(os.path.join(self.root, WANDB), remote) if offline else None
        else:
            self.root, self.mirror = storage.absolute(run_dir), None
            os.makedirs(self.root, exist_ok=True)
        label = "rank0" if primary else "validation"
        settings = wandb.Settings(x_label=label, console="auto" if primary else "off")
        if not offline:  # two writers of one run: W&B's shared mode
            settings = wandb.Settings(
                x_label=label, x_primary=primary, x_update_finish_state=primary
            )
        try:
            self.run = wandb.init(
                project=t.wandb_project,
                entity=t.wandb_entity or None,
                id=run_id(run_dir),
                name=storage.basename(run_dir),
                dir=self.root,
                config=job if primary else None,
                resume="allow",
                mode="offline" if offline else "shared",
                settings=settings,
                reinit="create_new",
            )
        except wandb.errors.Error as e:
            raise RuntimeError(
                f"tracking.wandb = true: W&B did not start ({type(e).__name__}: {e}); run "
                "`wandb login` (or set WANDB_API_KEY) where the job runs, or set "
                'tracking.wandb_mode = "offline" and `wandb sync` the run\'s wandb/ folder later'
            ) from e
        for axis in ("train", "validation"):
            self.run.define_metric(f"{axis}/step")
            self.run.define_metric(f"{axis}/*", step_metric=f"{axis}/step")

    def log(self, axis: str, step: int, values: dict) -> None:
        """``values`` (keys without the axis) at ``step`` of the ``train`` or ``validation``
        axis."""
        self.run.log({f"{axis}/{k}": v for k, v in values.items()} | {f"{axis}/step": step})

    def image(self, step: int, array, values: dict) -> None:
        """A validation grid (height x width x RGB) and ``values`` at ``step``."""
        import wandb

        self.log("validation", step, {"grid": wandb.Image(array)} | values)

    def push(self) -> None:
        """Offline files so far to a remote run folder (nothing for local runs or online)."""
        if self.mirror is not None:
            self.mirror.push(force=True)

    def finish(self) -> None:
        import wandb

        try:
            self.run.finish()
            # finish returns before W&B's service has written all of an offline run's log;
            # its teardown waits for that (this process holds no other W&B run)
            wandb.teardown()
        except (wandb.errors.Error, OSError) as e:  # the run's data stays in its local files
            log.warning("W&B run %s did not finish cleanly: %s", self.run.id, e)
        if self.mirror is not None:
            self.mirror.close()
        if self.temporary:
            shutil.rmtree(self.root, ignore_errors=True)
