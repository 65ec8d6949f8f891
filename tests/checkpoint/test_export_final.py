"""The final export streams (``checkpoint/export.final``): file by file from the
checkpoint's own filesystem, in pieces of at most ``storage.COPY_CHUNK``, and it never reads the
optimizer state (nor anything else outside ``export/`` but ``state.json``, where the step is,
and the checksums every copied byte is checked against).
The checkpoint is read through a filesystem that records every file opened and every read's
size; its ``optimizer.pt`` is a folder (nothing can read it as a file) and its export holds a
file three pieces long. No Ray needed."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import ray.train
from test_checkpoint_damage import _checkpoint

from raytuner import storage
from raytuner.checkpoint import files, layout
from raytuner.checkpoint.export import final as export_final


class _Reads:
    """A file object for ``pa.PythonFile`` that notes the size of every read."""

    def __init__(self, f, sizes: list) -> None:
        self.f, self.sizes, self.closed = f, sizes, False

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.sizes.append(len(data))
        return data

    def seek(self, *a):
        return self.f.seek(*a)

    def tell(self):
        return self.f.tell()

    def close(self) -> None:
        self.f.close()
        self.closed = True


class Recording(pafs.FileSystemHandler):
    """The local filesystem, noting each file opened for reading (path -> read sizes)."""

    def __init__(self) -> None:
        self.local, self.opened = pafs.LocalFileSystem(), {}

    def _open(self, path: str):
        sizes = self.opened.setdefault(path, [])
        return pa.PythonFile(_Reads(open(path, "rb"), sizes), mode="r")  # noqa: SIM115

    def open_input_stream(self, path):
        return self._open(path)

    def open_input_file(self, path):
        return self._open(path)

    def get_type_name(self):
        return "recording"

    def normalize_path(self, path):
        return path

    def get_file_info(self, paths):
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.local.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.local.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.local.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise OSError("not here")

    def delete_file(self, path):
        self.local.delete_file(path)

    def move(self, src, dest):
        self.local.move(src, dest)

    def copy_file(self, src, dest):
        self.local.copy_file(src, dest)

    def open_output_stream(self, path, metadata):
        return self.local.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path, metadata):
        return self.local.open_append_stream(path, metadata=metadata)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_the_final_export_streams_the_export_alone(tmp_path):
    folder = tmp_path / "runs" / "job" / "checkpoint_2026-01-01_00-00-01.000000"
    folder.mkdir(parents=True)
    _checkpoint(folder)
    big = folder / layout.EXPORT / layout.LORA_DIR / "big.bin"  # 2.5 pieces
    big.write_bytes(os.urandom(storage.COPY_CHUNK * 5 // 2))
    files.write_checksums(str(folder), 0)  # big.bin among the files it lists
    (folder / layout.OPTIMIZER).unlink()  # the optimizer state: a folder, not readable as a file
    (folder / layout.OPTIMIZER).mkdir()
    (folder / layout.OPTIMIZER / "state").write_bytes(b"never read")
    expected = _files(folder / layout.EXPORT)

    handler = Recording()
    checkpoint = ray.train.Checkpoint(str(folder), filesystem=pafs.PyFileSystem(handler))
    out = tmp_path / "out"
    summary = export_final(checkpoint, str(out), "job", "unet")

    assert _files(out / "job") == expected  # every file of the export, nothing else
    assert summary["lora"] == str(out / "job" / layout.LORA_DIR / layout.DIFFUSERS_FILE)
    assert summary["kohya"] == str(out / "job" / layout.LORA_DIR / layout.KOHYA_FILE)
    assert summary["step"] == 1
    opened = {str(Path(p).relative_to(folder)) for p in handler.opened}
    sums = f"{layout.CHECKSUMS}/rank-00000.json"  # what each copied file is checked against
    assert opened == {layout.STATE, sums} | {f"{layout.EXPORT}/{name}" for name in expected}
    chunk = storage.COPY_CHUNK  # the big file in its three pieces (a whole read: 80 of 256 KiB)
    assert [n for n in handler.opened[str(big)] if n] == [chunk, chunk, chunk // 2]
    assert all(max(s, default=0) <= storage.COPY_CHUNK for s in handler.opened.values())
