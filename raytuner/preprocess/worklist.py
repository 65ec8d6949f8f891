"""What a preprocess run must do with each input file, and the report: pure functions."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


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
    """Split probed rows (see ``sources.probe_row``) against the keys already encoded.

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
            (out.cached if row["key"] in available else out.new).append(row)
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
        },
        "buckets": dict(sorted(Counter(r["bucket"] for r in indexed).items())),
        "seconds": round(seconds, 3),
        "images_per_s": round(encoded / max(seconds, 1e-9), 3),
    }


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
        f"{c['truncated']} truncated; {report['seconds']:.1f} s, "
        f"{report['images_per_s']:.1f} images/s encoded"
    )
    out.append("  buckets: " + ", ".join(f"{b}: {n}" for b, n in report["buckets"].items()))
    for f in report.get("folders", []):  # sources with repeats_from_folder
        named = f", {f['name_captions']} captioned by its name" if f["name_captions"] else ""
        folder = f["folder"] or "(no N_ prefix)"
        out.append(f"  folder {folder}: {f['images']} images x {f['repeats']} repeats{named}")
    for s in skipped[:20]:
        out.append(f"  skipped {s['path']}: {s['reason']}")
    if len(skipped) > 20:
        out.append(f"  ... and {len(skipped) - 20} more (see the report)")
    return out
