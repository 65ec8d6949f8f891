"""What a preprocess run must do with each input file, and the report: pure functions."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from raytuner.data.keys import ALPHA, mask_key
from raytuner.preprocess.clips import report_line as clip_report_line
from raytuner.preprocess.sources import NOT_UTF8
from raytuner.preprocess.stream_rows import FAILED


@dataclass
class Plan:
    """Every probed file lands in exactly one list."""

    skipped: list[dict] = field(default_factory=list)  # {source, path, reason}
    duplicates: list[dict] = field(default_factory=list)  # {source, path, duplicate_of}
    cached: list[dict] = field(default_factory=list)  # probed rows whose key is already encoded
    new: list[dict] = field(default_factory=list)  # probed rows to decode and encode

    def skip(self, row: dict, reason: str) -> None:
        self.skipped.append({"source": row["source"], "path": row["path"], "reason": reason})

    def failed(self, reasons: dict[str, str]) -> None:
        """New images (by key) whose decode failed move from ``new`` to ``skipped``."""
        for row in [r for r in self.new if r["key"] in reasons]:
            self.skip(row, reasons[row["key"]])
        self.new = [r for r in self.new if r["key"] not in reasons]


def plan(probed: list[dict], available: set[str], sources: list[str]) -> Plan:
    """Split probed rows (see ``sources.probe_row``) against the keys already encoded: a row
    is cached when its latent and the flipped latent and mask it asks for (``flip_key``,
    ``mask_key``) all are.

    Byte-identical files share a key: the first in (source, path) order is trained, the others
    are reported as duplicates of it.
    """
    out, first_of = Plan(), {}
    for row in sorted(probed, key=lambda r: (r["source"], r["path"])):
        row = {**row, "source": sources[row["source"]]}
        if row["reason"]:
            out.skip(row, row["reason"])
        elif row["key"] in first_of:
            out.duplicates.append(
                {"source": row["source"], "path": row["path"], "duplicate_of": first_of[row["key"]]}
            )
        else:
            first_of[row["key"]] = row["path"]
            wanted = (row["key"], row.get("flip_key"), row.get("mask_key"))
            cached = all(k in available for k in wanted if k)
            (out.cached if cached else out.new).append(row)
    return out


def rejections(rows: list[dict], roots: list[str]) -> list[dict]:
    """The rejected files among the stream's rows (``roots``: its sources' folders), as their
    dataset remembers them (``data/trust.py``): each file the listing or the probe skipped
    (its key, where it was hashed) or the decode refused (also why, in which clip category,
    under which settings), so that a rerun reads none of them again unchanged."""
    out = []
    for r in rows:
        if not (r["reason"] or r["status"] == FAILED):
            continue
        refused = r["status"] == FAILED and not r["reason"]
        out.append(
            {"source": roots[r["source"]], "path": r["path"], "size": r["size"]}
            | {"mtime_ns": r["mtime_ns"], "key": r["key"]}
            | {k: r[k] if refused else "" for k in ("failure", "settings", "clip")}
        )
    return out


def pair_regularization(rows: list[dict]) -> list[dict]:
    """kohya sd-scripts' pairing of regularization images with the training images (its
    ``DreamBoothDataset``): an epoch holds as many regularization samples as training samples.
    In (source, path) order each regularization image is taken with its own repeats until
    their sum reaches the training samples, and the images after that are left out (0
    repeats); while the sum falls short, every image gets one repeat more in turn until it is
    reached. ``rows``: the trained rows (``repeats``, ``regularization``); returned with the
    regularization rows' repeats paired."""
    train = sum(r["repeats"] for r in rows if not r["regularization"])
    order = [i for i, r in enumerate(rows) if r["regularization"]]
    order.sort(key=lambda i: (rows[i]["source_index"], rows[i]["path"]))
    repeats, n, first = dict.fromkeys(order, 0), 0, True
    while order and n < train:
        for i in order:
            more = rows[i]["repeats"] if first else 1
            repeats[i], n = repeats[i] + more, n + more
            if n >= train:
                break
        first = False
    return [r | {"repeats": repeats[i]} if i in repeats else r for i, r in enumerate(rows)]


def unusable_sources(p: Plan, indexed: list[dict], roots: list[str], kinds: list[str]) -> list[str]:
    """Each source (``roots[i]``, a ``kinds[i]``: "source", "regularization source") that
    ends with no trained image, for a user: its folder and why each of its files was left out
    (skipped with the reason, or a duplicate)."""
    used = {r["source_index"] for r in indexed}
    out = []
    for i, root in enumerate(roots):
        if i in used:
            continue
        why = [f"{s['path']}: {s['reason']}" for s in p.skipped if s["source"] == root]
        why += [
            f"{d['path']}: a duplicate of {d['duplicate_of']}"
            for d in p.duplicates
            if d["source"] == root
        ]
        shown = "; ".join(why[:10]) + (f"; ... {len(why) - 10} more" if len(why) > 10 else "")
        left = f"{len(why)} file(s) left out ({shown})" if why else "no image file in it"
        out.append(f"{kinds[i]} {root}: {left}")
    return out


def _kinds(indexed: list[dict]) -> dict:
    """What the report says of flips, masks and regularization images (only what is there)."""
    out = {}
    if flipped := sum(1 for r in indexed if r.get("flip_key")):
        out["flipped"] = flipped
    masked = [r for r in indexed if r.get("mask_key")]
    if masked:
        alpha = sum(1 for r in masked if r["mask_key"] == mask_key(r["key"], ALPHA))
        out["masked"] = {"alpha": alpha, "file": len(masked) - alpha}
    reg = [r for r in indexed if r.get("regularization")]
    if reg:
        train = [r for r in indexed if not r.get("regularization")]
        out["regularization"] = {
            "images": len(reg),
            "unused": sum(1 for r in reg if not r["repeats"]),
            "samples": sum(r["repeats"] for r in reg),
            "training_images": len(train),
            "training_samples": sum(r["repeats"] for r in train),
        }
    return out


def report(total: int, p: Plan, indexed: list[dict], truncated: int, seconds: float) -> dict:
    """The preprocess report. ``indexed`` are the trained rows, with their bucket "WxH"."""
    encoded = len(p.new)
    return {
        "total": total,
        "encoded": encoded,
        "already_cached": len(p.cached),
        "duplicates": len(p.duplicates),
        "duplicate_files": p.duplicates,
        "skipped": p.skipped,
        "captions": {
            "distinct": len({r["caption"] for r in indexed}),
            "fallback": sum(1 for r in indexed if r["caption_from"] == "fallback"),
            "truncated": truncated,
            "not_utf8": sum(1 for r in indexed if r["caption_from"] == NOT_UTF8),
        },
        "buckets": dict(sorted(Counter(r["bucket"] for r in indexed).items())),
        "seconds": round(seconds, 3),
        "images_per_s": round(encoded / max(seconds, 1e-9), 3),
    } | _kinds(indexed)


def report_lines(report: dict) -> list[str]:
    """The preprocess report as the lines `raytuner preprocess` prints."""
    out = []
    skipped = report["skipped"]
    rows = [
        ("total", report["total"]),
        ("encoded", report["encoded"]),
        ("already cached", report["already_cached"]),
        ("duplicates", report["duplicates"]),
        ("skipped", len(skipped)),
    ]
    out.extend((f"  {name:<15}{n:>8}" for name, n in rows))
    c = report["captions"]
    out.append(
        f"  captions: {c['distinct']} distinct, {c['fallback']} from fallback, "
        f"{c['truncated']} truncated, {c.get('not_utf8', 0)} not UTF-8; "
        f"{report['seconds']:.1f} s, {report['images_per_s']:.1f} images/s encoded"
    )
    out.append("  buckets: " + ", ".join(f"{b}: {n}" for b, n in report["buckets"].items()))
    if t := report.get("text"):
        out.append(
            f"  text: {t['bytes_per_caption']:,} bytes a caption on average in {t['dtype']} "
            f"(at most {t['max_bytes_per_caption']:,}; preprocess.text_dtype)"
        )
    out.extend(_kind_lines(report))
    if "clips" in report:
        out.append(clip_report_line(report["clips"]))
    out.extend(_folder_lines(report.get("folders", [])))
    for f in report.get("not_utf8_files", [])[:20]:
        out.append(f"  caption not UTF-8 (bad bytes replaced by U+FFFD): {f['path']}")
    for s in skipped[:20]:
        out.append(f"  skipped {s['path']}: {s['reason']}")
    if len(skipped) > 20:
        out.append(f"  ... and {len(skipped) - 20} more (see the report)")
    return out


def _folder_lines(folders: list[dict]) -> list[str]:
    """The report's lines on the kohya folders (``<N>_<name>``) of the sources."""
    out = []
    for f in folders:
        named = f", {f['name_captions']} captioned by its name" if f["name_captions"] else ""
        folder = f["folder"] or "(no N_ prefix)"
        line = f"  folder {folder}: {f['images']} images x {f['repeats']} repeats{named}"
        if f["folder"] and not f.get("taken", True):
            line += (
                f" (its name says {f['named']}: set repeats_from_folder = true on its source "
                "to take it)"
            )
        out.append(line)
    return out


def _kind_lines(report: dict) -> list[str]:
    """The report's lines on flips, masks and regularization images (where it has them)."""
    out = []
    if "flipped" in report:
        out.append(f"  flipped: {report['flipped']} images (each with its mirror image's latent)")
    if m := report.get("masked"):
        out.append(f"  masked: {m['alpha']} by their alpha channel, {m['file']} by mask files")
    if p := report.get("pairs"):
        out.append(
            f"  pairs: {p['targets']} targets with {p['references']} reference images "
            f"(up to {p['per_target']} each; {p['encoded']} encoded now)"
            + (
                f"; {p['texts_encoded']} text rows encoded with their references now"
                if "texts_encoded" in p
                else ""
            )
        )
    if g := report.get("regularization"):
        out.append(
            f"  regularization: {g['images']} images ({g['unused']} left out), {g['samples']} "
            f"samples an epoch for the {g['training_samples']} of {g['training_images']} "
            "training images (kohya's pairing)"
        )
    return out
