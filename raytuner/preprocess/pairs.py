"""Edit / reference-image pairs (driver side, no torch): which reference (control) images each
target image of a source has, and the reference files as rows of the stream of their own.

A target's references come from one of two places (the conventions of the other trainers):

- a folder (``[[data.sources]] references = "<folder>"``, relative to the source folder unless
  absolute or a URI) holding, for the target ``<stem>.<ext>`` of the source (subfolders
  mirrored), ``<stem>.<any image ext>`` and/or ``<stem>_0``, ``<stem>_1`` … (in that order):
  musubi-tuner's ``control_directory``, ai-toolkit's ``control_path`` folder (the same file
  name), SimpleTuner's conditioning dataset of the same file names;
- the source's metadata table (jsonl / csv / parquet, ``file_name`` and ``text``) with a
  reference column: ``control_path`` (musubi-tuner, ai-toolkit), ``conditioning_image``
  (diffusers' ControlNet scripts, Hugging Face datasets) or ``reference``, a file name or a
  list of them, and their numbered forms ``control_path_0``, ``control_path_1`` … (musubi-tuner),
  each relative to the references folder when the source names one, else to the source folder.

A source that has either is *paired*: each of its targets trains with its references, and a
target with none (or one that is missing, links out of its folder or is named twice) is
skipped with the reason. A reference is encoded as an image of its own (its own bucket of the
target's resolution, keyed by its content): it is a row of the stream whose source is the
reference source ``reference_source(sources[i])`` (index ``n + i`` of ``n`` sources), so that
probing, decoding, encoding and caching are those of every image, and a reference shared by
several targets, or already cached, is encoded once."""

from __future__ import annotations

import dataclasses
import posixpath
import re

from raytuner import storage
from raytuner.config import SourceConfig

# metadata columns naming a target's references, in the order they are taken
REFERENCE_COLUMNS = ("control_path", "conditioning_image", "reference")
_NUMBERED = re.compile(r"(control_path|conditioning_image|reference)_([0-9]+)")
ROLE_TARGET, ROLE_REFERENCE = "target", "reference"


def reference_root(source: SourceConfig) -> str:
    """Where a source's references are read from: its ``references`` folder (relative to the
    source folder unless absolute or a URI), else the source folder itself."""
    if not source.references:
        return storage.absolute(source.path)
    if "://" in source.references or source.references.startswith(("/", "~")):
        return storage.absolute(source.references)
    return storage.join(storage.absolute(source.path), source.references)


def reference_source(source: SourceConfig) -> SourceConfig:
    """The stream's source of a source's reference files: its reference folder, each file
    captioned "" (a reference has no caption of its own), never flipped or masked."""
    return SourceConfig(
        path=reference_root(source), caption_fallback="empty", flip="none", mask="none"
    )


def with_reference_sources(sources: list[SourceConfig]) -> list[SourceConfig]:
    """The stream's sources: the job's, then the reference source of each (index ``n + i``)."""
    return list(sources) + [reference_source(s) for s in sources]


def _column_order(column: str) -> tuple[int, int] | None:
    if column in REFERENCE_COLUMNS:
        return (0, REFERENCE_COLUMNS.index(column))
    if m := _NUMBERED.fullmatch(column):
        return (1 + int(m.group(2)), REFERENCE_COLUMNS.index(m.group(1)))
    return None


def metadata_references(rows: list[dict]) -> dict[str, list[str]] | None:
    """``file_name -> [reference names]`` of a metadata table's rows (None: the table has no
    reference column). A cell is a name or a list of names; empty cells add none."""
    names = {c for r in rows for c in r}  # a jsonl row names only its own columns
    columns = sorted((order, c) for c in names if (order := _column_order(c)) is not None)
    if not columns:
        return None
    out = {}
    for r in rows:
        refs: list[str] = []
        for _, column in columns:
            value = r.get(column)
            values = value if isinstance(value, list) else [value]
            refs += [str(v).strip() for v in values if v is not None and str(v).strip()]
        out[posixpath.normpath(str(r["file_name"]))] = refs
    return out


@dataclasses.dataclass(frozen=True)
class Pairing:
    """How a paired source's targets find their references."""

    root: str  # reference_root: where the names lie
    files: dict  # its files: rel -> (size, mtime_ns)
    named: dict[str, list[str]] | None  # the metadata's names (None: matched by stem)
    inside: str | None  # the reference folder's path in the source folder ("": the source
    # folder itself; None: outside it)
    escapes: object  # rel -> whether it is a symlink out of the reference folder
    names: frozenset[str] = frozenset()  # every file the metadata names


def make_pairing(source: SourceConfig, files: dict, table: list[dict] | None, listed, escapes):
    """The pairing of a source (None: it is not paired): ``files``, the source folder's files;
    ``table``, its metadata rows; ``listed(fs, folder)``, a folder's files; ``escapes(fs, root,
    path)``, whether a path is a symlink out of ``root``. A references folder that is not
    there is a ValueError naming it."""
    named = metadata_references(table) if table else None
    if not source.references and named is None:
        return None
    root, here = reference_root(source), storage.absolute(source.path)
    fs, path = storage.resolve(root)
    if root == here:
        inside, ref_files = "", files
    elif root.startswith(here + "/"):
        inside = root[len(here) + 1 :]
        cut = len(inside) + 1
        ref_files = {r[cut:]: v for r, v in files.items() if r.startswith(inside + "/")}
    else:
        inside, ref_files = None, None
    if fs.get_file_info(path).type.name != "Directory":
        raise ValueError(f"references folder {root!r} of source {source.path!r} is not a folder")
    if ref_files is None:
        ref_files = listed(fs, path)
    names = frozenset(posixpath.normpath(n) for ns in (named or {}).values() for n in ns)
    return Pairing(
        root,
        ref_files,
        named,
        inside,
        lambda rel: escapes(fs, path, storage.join(path, rel)),
        names,
    )


def _stems(files, is_image) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for rel in files:
        stem, ext = posixpath.splitext(rel)
        if is_image(ext):
            out.setdefault(stem, []).append(rel)
    return out


def _by_stem(pairing: Pairing, rel: str, is_image) -> tuple[list[str], str]:
    stems = _stems(pairing.files, is_image)
    stem = posixpath.splitext(rel)[0]
    exact = sorted(stems.get(stem, []))
    if len(exact) > 1:
        return [], f"two reference images of one name: {', '.join(exact)} (keep one)"
    numbered = []
    n = 0
    while f"{stem}_{n}" in stems:
        found = sorted(stems[f"{stem}_{n}"])
        if len(found) > 1:
            return [], f"two reference images of one name: {', '.join(found)} (keep one)"
        numbered.append(found[0])
        n += 1
    refs = exact + numbered
    if not refs:
        return [], (
            f"no reference image: neither {stem}.<ext> nor {stem}_0.<ext> in {pairing.root} "
            "(data.sources.references)"
        )
    return refs, ""


def references_of(pairing: Pairing, rel: str, is_image) -> tuple[list[str], str]:
    """A target's references (paths in ``pairing.root``) and "" or, when it cannot train as a
    pair, no references and the reason its target is skipped."""
    if pairing.named is None:
        refs, why = _by_stem(pairing, rel, is_image)
    else:
        refs, why = pairing.named.get(rel, []), ""
        if not refs:
            why = "no reference image named in its metadata row (control_path)"
        for name in refs:
            if name.startswith("/") or "://" in name or posixpath.normpath(name).startswith(".."):
                why = why or f"reference {name!r} lies outside {pairing.root}"
            elif posixpath.normpath(name) not in pairing.files:
                why = why or f"reference {name!r} is missing (in {pairing.root})"
        refs = [posixpath.normpath(n) for n in refs]
    for name in refs if not why else []:
        if pairing.escapes(name):
            why = f"reference {name!r} is a symlink outside its folder"
        elif pairing.files[name][0] == 0:
            why = f"reference {name!r} is an empty file"
    return (refs, "") if not why else ([], why)


def is_reference_file(pairing: Pairing | None, rel: str) -> bool:
    """Whether a file of the source folder is one of its references (never a target)."""
    if pairing is None or pairing.inside is None:
        return False
    if pairing.inside:
        return rel.startswith(pairing.inside + "/")
    return rel in pairing.names


def reference_rows(rows: list[dict], index: int, pairing: Pairing) -> list[dict]:
    """One listed row per distinct reference file of the targets in ``rows`` (one source's),
    of the reference source ``index``, in the form ``sources.list_source`` gives."""
    names = sorted({name for r in rows for name in r["references"]})
    return [
        {
            "source": index,
            "path": name,
            "size": pairing.files[name][0],
            "mtime_ns": pairing.files[name][1],
            "caption_path": "",
            "metadata_caption": None,
            "mask_path": "",
            "refused": "",
            "references": [],
            "role": ROLE_REFERENCE,
        }
        for name in names
    ]


def join_references(rows: list[dict], listing: list[dict], roots: list[str]) -> tuple:
    """The stream's rows split into the targets' (of the first ``len(roots) // 2`` sources:
    ``roots``, the stream's source folders) and the references'; each target gets its
    references in order (``reference_keys`` and where they came from: ``reference_root``,
    ``_paths``, ``_sizes``, ``_mtimes``), and a target whose reference was skipped or could not
    be decoded is skipped naming it."""
    count = len(roots) // 2
    by_place = {(r["source"], r["path"]): r for r in rows}
    targets, references = [], [r for r in rows if r["source"] >= count]
    named = {(r["source"], r["path"]): r["references"] for r in listing if r["source"] < count}
    for r in (r for r in rows if r["source"] < count):
        refs = [by_place[(count + r["source"], n)] for n in named.get((r["source"], r["path"]), [])]
        why = ""
        for ref in refs:
            failure = ref["reason"] or (ref["failure"] if ref["status"] == "failed" else "")
            why = why or (f"reference {ref['path']!r}: {failure}" if failure else "")
        targets.append(
            r
            | {
                "reason": r["reason"] or why,
                "reference_root": roots[count + r["source"]] if refs else "",
                "reference_paths": [x["path"] for x in refs],
                "reference_sizes": [x["size"] for x in refs],
                "reference_mtimes": [x["mtime_ns"] for x in refs],
                "reference_keys": [x["key"] for x in refs],
            }
        )
    return targets, references


def text_sources(listing: list[dict], family) -> frozenset[int]:
    """The sources whose captions the stream leaves to ``pair_text`` (encoded with their
    references): the paired ones (a target listed with references), for a family whose text
    encoder sees the references (``References.text``); else none."""
    if not family.references.text:
        return frozenset()
    return frozenset(r["source"] for r in listing if r.get("references"))


def matched(indexed: list[dict], latents: dict, family) -> tuple[list, list[tuple[dict, str]]]:
    """The trained targets whose references share their bucket and are as many as the family
    takes (``family.references.most``), and the others with the reason they are skipped (an
    edit pair's images are batched together: one bucket, the target's)."""
    kept, skipped, most = [], [], family.references.most
    for r in indexed:
        n = len(r["reference_keys"])
        why = f"{n} reference images; {family.name} takes at most {most}" if n > most else ""
        for path, key in zip(r["reference_paths"], r["reference_keys"], strict=True):
            ref = latents[key]
            size = f"{ref['width']}x{ref['height']}"
            if size != r["bucket"] and not why:  # the first reason is the one reported
                why = (
                    f"reference {path!r} falls in bucket {size}, its target in {r['bucket']}: "
                    "an edit pair's images must have about the same aspect ratio"
                )
        (skipped.append((r, why)) if why else kept.append(r))
    return kept, skipped


def pair_report(indexed: list[dict], references: list[dict], encoded: set[str]) -> dict:
    """The report's ``pairs`` (only for a paired dataset): the trained targets with references,
    their reference images (distinct files) and how many of them this run encoded."""
    paired = [r for r in indexed if r.get("reference_keys")]
    if not paired and not references:
        return {}
    used = {k for r in paired for k in r["reference_keys"]}
    return {
        "pairs": {
            "targets": len(paired),
            "references": len(used),
            "per_target": max((len(r["reference_keys"]) for r in paired), default=0),
            "encoded": len(used & encoded),
        }
    }
