"""Which committed clips a rerun trusts without reading them (``data/clip_rows.py``): a clip's
whole run of samples under the frame settings its dataset recorded, never one two indexes
disagree on. The end-to-end case is tests/preprocess/test_clips.py (slow)."""

from __future__ import annotations

import json

from raytuner.config import DataConfig
from raytuner.data import clip_rows, datasets

ROOT = "/data/clips"


def sample(path: str, i: int, *, content="ab" * 32, frames=9, size=1000, mtime=7) -> dict:
    key = clip_rows.sample_key(content, frames, "chunks", 0.0, i)
    return {"source": ROOT, "source_index": 0, "path": path, "key": key, "size": size} | {
        "mtime_ns": mtime
    }


def source(**settings):
    """The job's source of ``ROOT`` as ``DataConfig.all_sources`` resolves it."""
    return DataConfig(images=ROOT, cache="/tmp/cache", **settings).all_sources()[0]


def record(**settings) -> list[dict]:
    """A dataset's sources record as the manifest holds it (through JSON)."""
    sources = [source(frame_selection="chunks", **settings)]
    return json.loads(json.dumps(datasets.sources_record(sources)))


def held(*indexes) -> dict:
    out: dict = {}
    for rows, rec in indexes:
        gathered: dict = {}
        clip_rows.gather(rows, rec, gathered)
        clip_rows.take(gathered, out)
    return out


def test_a_clips_whole_run_of_samples_is_trusted_under_its_recorded_frame_settings():
    image = {**sample("a.png", 0), "key": "cd" * 32}
    rows = [sample("run.mp4", 1), image, sample("run.mp4", 0), sample("gap.mp4", 0)]
    rows.append(sample("gap.mp4", 2))  # its sample 1 is not in the index: read again
    got = held((rows, record(frames=[5, 9])))
    settings = datasets.source_frame_settings(source(frame_selection="chunks", frames=[5, 9]))
    assert got[(ROOT, "run.mp4", settings)] == (1000, 7, sample("run.mp4", 0)["key"], 2)
    assert got[(ROOT, "gap.mp4", settings)] is None
    assert len(got) == 2  # no image
    other = datasets.source_frame_settings(source(frame_selection="chunks", frames=[5]))
    assert (ROOT, "run.mp4", other) not in got  # other frame counts: not known, read
    assert held((rows, None)) == {}  # an index from before datasets: every clip read


def test_two_indexes_that_disagree_on_a_clip_trust_it_in_neither():
    rec = record(frames=[9])
    first = [sample("run.mp4", 0)]
    same = held((first, rec), (first, rec))
    assert list(same.values()) == [(1000, 7, first[0]["key"], 1)]
    later = [sample("run.mp4", 0, mtime=8)]  # another job committed it after an edit
    assert list(held((first, rec), (later, rec)).values()) == [None]
    more = [sample("run.mp4", 0), sample("run.mp4", 1)]
    assert list(held((first, rec), (more, rec)).values()) == [None]


def test_default_frame_settings_left_out_of_a_record_are_its_sources():
    """A record leaves the defaults out (``frames = [81]``, ``head``, fps 0): the same settings."""
    default = source()
    rec = json.loads(json.dumps(datasets.sources_record([default])))[0]
    assert "frames" not in rec
    assert datasets.frame_settings(rec) == datasets.source_frame_settings(default)
    assert datasets.frame_settings(rec) == ((81,), "head", 0.0)
