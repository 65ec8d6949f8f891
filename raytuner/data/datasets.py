"""The datasets of a cache version: one per job's sources, so that jobs can share a cache.

A cache version (one model and encoding) holds the encoded rows of every job that
preprocessed into it; its data files are shared, keyed by content. What a job trains is its
dataset: the index of the rows its own sources make (their images, captions, repeats, flips,
masks, regularization). The manifest keeps every job's dataset under ``datasets``, keyed by
``dataset_key`` of the job's sources (each one's folder and settings), each with its own
index and captions tables, the data files it reads and what its sources were. A preprocess
replaces only its own job's entry; ``raytuner train`` reads only its own job's, and refuses
when the cache has none (``entry``), naming what it holds instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from raytuner import storage
from raytuner.data.cache import DATASETS, indexes

# settings added after caches were made, and what a source had before them: a source names
# one only when it changes it, so that the datasets committed before it keep their keys
_ADDED = {"references": "", "frames": [81], "frame_selection": "head", "fps": 0.0}

# the settings a source has by default: a source is described by the ones it changes
# (``repeats_from_folder``, true for data.images and false for [[data.sources]], is not)
_DEFAULTS = {
    "repeats": 1,
    "caption_extension": ".txt",
    "caption_fallback": "stem",
    "caption_errors": "replace",
    "metadata": "",
    "regularization": False,
    "flip": "none",
    "mask": "none",
    **_ADDED,
}


def sources_record(sources) -> list[dict]:
    """What a job's sources (``DataConfig.all_sources()``) say of the rows they make: every
    setting of each source, in order, its folder as an absolute path or URI."""
    return [_record(s) for s in sources]


def _record(source) -> dict:
    """A source's settings, those of ``_ADDED`` only when changed (old keys stay valid)."""
    out = dataclasses.asdict(source) | {"path": storage.absolute(source.path)}
    for k, default in _ADDED.items():
        if k in out and out[k] == default:
            out.pop(k)
    return out


def frame_settings(record: dict) -> tuple:
    """What a source's clips are sampled with: its frame counts, frame selection and fps, from
    its ``sources_record`` entry (one that leaves them out has their defaults)."""
    frames = record.get("frames", _ADDED["frames"])
    selection = record.get("frame_selection", _ADDED["frame_selection"])
    return tuple(int(n) for n in frames), str(selection), float(record.get("fps", _ADDED["fps"]))


def newest_sources(manifest: dict) -> list[dict]:
    """The ``sources_record`` of a version's newest commit's dataset (the one its manifest's
    own ``index`` is of); [] for a manifest from before datasets were kept apart."""
    return manifest.get(DATASETS, {}).get(manifest.get("dataset_key"), {}).get("sources", [])


def source_rates(record: list[dict]) -> list[float]:
    """Each source's sampling fps from a ``sources_record``, in order: what the reader gives
    each of its rows as its frame rate (``"fps"``); 0.0 where it samples each clip at its own
    rate (not known here), and for a source whose rate was left to ``data.fps`` unresolved
    (-1, ``SourceConfig``'s default, as ``all_sources`` never leaves it)."""
    return [max(frame_settings(s)[2], 0.0) for s in record]


def source_frame_settings(source) -> tuple:
    """``frame_settings`` of a ``SourceConfig``."""
    return frame_settings(_record(source))


def dataset_key(sources) -> str:
    """The key of a job's dataset in its cache version: a hash of ``sources_record``. Two jobs
    with the same sources share a dataset; any other folder or setting is another one."""
    text = json.dumps(sources_record(sources), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def dataset_id(fingerprint: str, rows: list[dict]) -> str:
    """The identity of the trained rows (index rows) in their order: what each row is (image
    and caption content), how often it appears, whether it is a regularization image, flipped
    and masked (by what). Moving the source folders keeps it; adding, removing, renaming or
    editing an image, editing a caption or a mask, changing repeats or a source's
    regularization, flip or mask setting does not."""
    digest = hashlib.sha256(fingerprint.encode())
    for r in rows:
        fields = (r["source_index"], r["path"], r["key"], r["caption_key"], r["repeats"])
        fields += (r["regularization"], bool(r["flip_file"]), r["mask_key"])
        fields += tuple(r.get("reference_keys") or ())  # an edit pair's (none: as before)
        digest.update(("\0".join(map(str, fields)) + "\n").encode())
    return digest.hexdigest()[:16]


def describe(record: list[dict]) -> str:
    """A ``sources_record`` for a user: each folder with the settings it changes."""
    out = []
    for s in record:
        changed = [f"{k} {v!r}" for k, v in s.items() if k in _DEFAULTS and v != _DEFAULTS[k]]
        out.append(s["path"] + (f" ({', '.join(changed)})" if changed else ""))
    return "; ".join(out)


def _difference(mine: list[dict], theirs: list[dict]) -> str:
    """How the sources of a dataset of the same folders differ from the job's ("" if the
    folders differ)."""
    if [s["path"] for s in mine] != [s["path"] for s in theirs]:
        return ""
    changes = [
        f"{s['path']} {k} = {t.get(k)!r} there, {v!r} here"
        for s, t in zip(mine, theirs, strict=True)
        for k, v in s.items()
        if k != "path" and t.get(k) != v
    ]
    return "; ".join(changes)


def entry(manifest: dict, sources, root: str) -> dict:
    """The job's dataset in a committed version (``sources``: its ``all_sources()``); a
    FileNotFoundError saying what is missing and what the version holds instead when the job's
    sources never committed one."""
    key, record = dataset_key(sources), sources_record(sources)
    held = manifest.get(DATASETS, {})
    if key in held:
        return held[key]
    near = [d for d in (_difference(record, o["sources"]) for o in held.values()) if d]
    if near:
        instead = f"a dataset of the same folders with other settings ({near[0]})"
    elif held:
        instead = f"{len(held)} other job(s)' datasets: " + " | ".join(
            describe(o["sources"]) for o in held.values()
        )
    else:  # committed before each job's dataset was kept apart
        instead = "one dataset committed before raytuner kept each job's rows apart"
    return _missing(root, record, instead)


def _missing(root: str, record: list[dict], instead: str) -> dict:
    raise FileNotFoundError(
        f"the cache at {root} holds no dataset of this job's sources ({describe(record)}); "
        f"it holds {instead}. Run `raytuner preprocess` (or `raytuner run`) with this job "
        "first: it encodes only what the cache lacks, and never changes another job's rows"
    )


def sharing(manifest: dict, roots) -> tuple[list[tuple[dict, dict]], set[str]]:
    """What a preprocess of a job on source folders ``roots`` reads of a committed version:
    the (index, captions) entries of the datasets that read one of those folders, and the data
    files that only the other datasets read. Every dataset is read when ``roots`` is None, when
    one of them is a folder no dataset read yet (a new or moved folder: its images may be
    cached under another one) and for a manifest from before datasets were kept apart."""
    held = manifest.get(DATASETS, {})
    mine = set(roots or ())
    read = {s["path"] for d in held.values() for s in d["sources"]}
    if roots is None or not held or not mine <= read:
        return indexes(manifest), set()
    shares = {k: bool(mine & {s["path"] for s in d["sources"]}) for k, d in held.items()}

    def files(wanted: bool) -> set[str]:
        return {
            f
            for k, d in held.items()
            if shares[k] == wanted
            for kind in ("latents", "text")
            for f in d["files"][kind]
        }

    tables = [(d["index"], d["captions"]) for k, d in held.items() if shares[k]]
    return tables, files(False) - files(True)


def merged(held: dict, key: str, mine: dict, exists) -> tuple[dict, list[str]]:
    """The version's datasets after a commit of ``mine`` under ``key``: the others kept as they
    are, except one whose files are gone (``exists(rel)`` false for one of them: a repair set
    it aside), which is dropped (its job preprocesses again); and the dropped ones' sources.
    One whose table of rejected files is gone keeps the rest: its job probes those files again
    (``data/trust.py``)."""
    out, dropped = {}, []
    for other, d in held.items():
        if other == key:
            continue
        files = [*d["files"]["latents"], *d["files"]["text"], d["index"]["path"]]
        if not all(exists(rel) for rel in [*files, d["captions"]["path"]]):
            dropped.append(describe(d["sources"]))
        elif (rejected := d.get("rejected")) and not exists(rejected["path"]):
            out[other] = {k: v for k, v in d.items() if k != "rejected"}
        else:
            out[other] = d
    return out | {key: mine}, dropped


def _setting(row: dict, what: str):
    """An index row's repeats, regularization, flip (whether it has a flipped latent) or mask
    (its key); an index written before a setting existed has its default."""
    if what == "flip":
        return bool(row.get("flip_file"))
    return row.get({"mask": "mask_key"}.get(what, what), "" if what == "mask" else False)


def describe_change(old: list[dict], new: list[dict], limit: int = 5) -> str:
    """What differs between two indexes' rows (by source and path; a source is its place in
    the job, so a moved folder is the same source), for a user: images added, removed or
    edited, captions and repeats changed."""

    def keyed(rows):
        return {(r["source_index"], r["path"]): r for r in rows}

    a, b = keyed(old), keyed(new)
    groups = {
        "added": [p for p in b if p not in a],
        "removed": [p for p in a if p not in b],
        "edited": [p for p in a.keys() & b.keys() if a[p]["key"] != b[p]["key"]],
        "caption changed": [
            p for p in a.keys() & b.keys() if a[p]["caption_key"] != b[p]["caption_key"]
        ],
    }
    for what in ("repeats", "regularization", "flip", "mask"):
        groups[f"{what} changed"] = [
            p for p in a.keys() & b.keys() if _setting(a[p], what) != _setting(b[p], what)
        ]
    parts = []
    for what, paths in groups.items():
        if paths:
            shown = ", ".join(p for _, p in sorted(paths)[:limit])
            more = f", … {len(paths) - limit} more" if len(paths) > limit else ""
            parts.append(f"{len(paths)} {what} ({shown}{more})")
    return "; ".join(parts) or "the same images in another order"
