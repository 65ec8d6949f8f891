"""The job check's rules about this installation and this machine (``raytuner.jobcheck``): the
optional packages a job needs, outputs that would land in Ray's temporary copy of a working dir,
and the image folders (docs/architecture.md's table lists every rule)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import PurePath

import pyarrow.fs as pafs

from raytuner import storage
from raytuner.config import ConfigError, DataConfig, JobConfig, SourceConfig, TrackingConfig
from raytuner.observe import tracking
from raytuner.train.optim import missing_package

log = logging.getLogger("raytuner")

# Ray unpacks a job's working dir (and any runtime_env working_dir) into
# <temp dir>/session_*/runtime_resources/working_dir_files/_ray_pkg_<hash>/ and starts the job's
# entrypoint there (Ray 2.60: ray/_private/runtime_env/working_dir.py); a job's driver also gets
# RAY_JOB_CONFIG_JSON_ENV_VAR (its runtime_env, from dashboard/modules/job/job_supervisor.py)
RAY_WORKING_DIRS = ("runtime_resources", "working_dir_files")
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def packages(job: JobConfig) -> None:
    """The optimizer's and the trackers' packages are installed."""
    if package := missing_package(job.train.optimizer):
        raise ConfigError(
            f"train.optimizer = {job.train.optimizer!r} needs the {package} package: "
            "pip install 'raytuner[lowvram]', or use adamw or adafactor"
        )
    _trackers(job.tracking)


def _trackers(t: TrackingConfig) -> None:
    if t.wandb and tracking.missing():
        raise ConfigError(
            "tracking.wandb = true needs the wandb package, which is not installed: "
            f"{tracking.INSTALL} (or pip install wandb), or set tracking.wandb = false"
        )


def ray_working_dir(cwd: str | None = None) -> str | None:
    """The copy of a working dir Ray unpacked that ``cwd`` (the working directory) lies in, or
    None: the folder ``…/runtime_resources/working_dir_files/<package>``."""
    parts = PurePath(cwd or os.getcwd()).parts
    for i in range(len(parts) - 2):
        if parts[i : i + 2] == RAY_WORKING_DIRS:
            return str(PurePath(*parts[: i + 3]))
    return None


def outputs_outside_ray_working_dir(job: JobConfig) -> None:
    """Inside Ray's copy of a working dir, a relative ``data.cache`` or ``train.output`` would
    be written into that copy: on one node, deleted with it, and under another package folder
    once a file of the working dir changes (no resume, the cache encoded again)."""
    copy = ray_working_dir()
    if copy is None:
        return
    relative = [
        (key, path)
        for key, path in (("data.cache", job.data.cache), ("train.output", job.train.output))
        if "://" not in path and not os.path.isabs(os.path.expanduser(path))
    ]
    if not relative:
        return
    how = "a Ray job's working dir" if _ray_job() else "a Ray runtime_env working_dir"
    keys = " and ".join(f"{key} = {path!r}" for key, path in relative)
    key, path = relative[0]
    raise ConfigError(
        f"{keys} {'is' if len(relative) == 1 else 'are'} relative, and this runs in {how}: "
        f"{'it' if len(relative) == 1 else 'they'} would be written under {copy}, Ray's "
        "temporary copy of it on this node, which other nodes do not see and Ray deletes; set "
        "an absolute path every node reaches (a shared filesystem) or an s3:// or gs:// URI, "
        f"e.g. --set {key}=s3://bucket/{os.path.basename(os.path.normpath(path))}"
    )


def _ray_job() -> bool:
    """This process is a Ray job's driver (`ray job submit`): Ray hands it its job config."""
    try:
        return isinstance(json.loads(os.environ.get(RAY_JOB_ENV, "")), dict)
    except ValueError:
        return False


def _local_folders(data: DataConfig) -> list[tuple[str, int, SourceConfig]]:
    """(key, index among ``data.all_sources()``, source) of each image folder on this machine's
    filesystem: a path, or a ``file://`` URI."""
    keys = ["data.images"] if data.images else []
    keys += [f"data.sources[{i}].path" for i in range(len(data.sources))]
    return [
        (key, i, source)
        for i, (key, source) in enumerate(zip(keys, data.all_sources(), strict=True))
        if "://" not in source.path or source.path.startswith("file://")
    ]


def image_folders(data: DataConfig) -> None:
    """Each local image folder exists and the preprocess's listing finds at least one image in
    it that it would encode; the counts are logged once every folder passed."""
    from raytuner.preprocess.sources import IMAGE_EXTENSIONS, list_source

    counts = []
    for key, i, source in _local_folders(data):
        fs, root = storage.resolve(source.path)
        shown = f"{key} = {source.path!r}"
        where = "" if root == source.path else f" ({root})"
        kind = fs.get_file_info(root).type
        if kind == pafs.FileType.NotFound:
            relative = "://" not in source.path and not os.path.isabs(
                os.path.expanduser(source.path)
            )
            raise ConfigError(
                f"{shown}: no such folder{where}; set it to the folder of your images"
                + (" (a relative path is from the working directory)" if relative else "")
            )
        if kind != pafs.FileType.Directory:
            raise ConfigError(f"{shown}: not a folder{where}; set it to the folder of your images")
        try:
            rows = list_source(i, source)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{shown}: {e}") from None
        usable = sum(not r["refused"] for r in rows)
        if not rows:
            extensions = ", ".join(sorted(IMAGE_EXTENSIONS))
            raise ConfigError(
                f"{shown}: holds no image{where} (searched recursively for {extensions}; "
                "hidden files skipped)"
            )
        if not usable:
            first = rows[0]
            raise ConfigError(
                f"{shown}: none of its {len(rows)} images would be encoded ({first['path']}: "
                f"{first['refused']})"
            )
        counts.append((shown, usable, len(rows) - usable))
        _references_folder(key, source)
    for shown, usable, skipped in counts:
        log.info("%s: %d images%s", shown, usable, f" ({skipped} skipped)" if skipped else "")


def _references_folder(key: str, source) -> None:
    """A local source's ``references`` folder (edit pairs) exists: else every pair would be
    reported missing a reference after the whole folder was read and encoded."""
    from raytuner.preprocess.pairs import reference_root

    if not source.references or "://" in source.references:
        return
    root = reference_root(source)
    fs, path = storage.resolve(root)
    kind = fs.get_file_info(path).type
    what = {pafs.FileType.NotFound: "no such folder", pafs.FileType.File: "not a folder"}
    if kind in what:
        name = key.replace(".path", ".references") if key.endswith(".path") else "data.references"
        raise ConfigError(
            f"{name} = {source.references!r}: {what[kind]} ({path}; a relative one is read from "
            f"the source folder {source.path!r}); set it to the folder of the reference images"
        )
