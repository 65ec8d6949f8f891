"""`raytuner demo`, end to end as a user runs it, and its LoRA in a diffusers SDXL pipeline.

The demo runs through the CLI's own ``main`` in this process, on the session's local Ray: the
same code as `raytuner demo` less an interpreter start, a torch import and a Ray start (~20 s
on 2 cores). The CLI as a process of its own, starting and ending its own local Ray, is what
tests/data/test_cache_ops.py and tests/data/test_s3.py run."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from run_checks import pipeline_image

from raytuner.families.parts import Source

TINY = Source("tiny")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_demo_trains_a_lora_that_diffusers_loads(ray_local, tmp_path, capsys, monkeypatch):
    from raytuner.cli import main
    from raytuner.families import FAMILIES

    monkeypatch.chdir(REPO)
    start = time.monotonic()
    code = main(["demo", "--workdir", str(tmp_path / "demo")])
    out, err = capsys.readouterr()
    print(f"demo took {time.monotonic() - start:.0f} s")
    # the CLI's one line on a failure, among the Ray workers' output
    assert code == 0, [line for line in err.splitlines() if line.startswith("raytuner:")]
    assert "images encoded : 24 of 24" in out
    assert "48x80 (8), 64x64 (8), 80x48 (8)" in out
    assert "steps          : 30 on 2 workers" in out
    lora_dir = tmp_path / "demo" / "runs" / "demo" / "lora"
    assert f"LoRA           : {lora_dir}/pytorch_lora_weights.safetensors" in out
    assert (tmp_path / "demo" / "preprocess-report.json").is_file()

    def image(lora_file: str | None = None):
        pipe = FAMILIES["sdxl"].pipeline(TINY)
        if lora_file:
            pipe.load_lora_weights(str(lora_dir), weight_name=lora_file)
        return pipeline_image(pipe)

    before, after = image(), image("pytorch_lora_weights.safetensors")
    assert after.shape == (1, 64, 64, 3) and np.isfinite(after).all()
    assert not np.allclose(before, after)
    # the kohya layout of the same LoRA (for ComfyUI / A1111) gives the same image
    np.testing.assert_allclose(image("lora_kohya.safetensors"), after, atol=1e-5)

    # the README's next command: the run's latest checkpoint through `raytuner sample`
    from PIL import Image

    job, samples = str(tmp_path / "demo" / "demo.toml"), tmp_path / "samples"
    code = main(["sample", job, "--prompt", "a red circle", "--steps", "2", "--out", str(samples)])
    png = samples / "00-a-red-circle-seed0.png"
    assert code == 0 and f"wrote {png}" in capsys.readouterr().out
    with Image.open(png) as rendered:
        assert rendered.size == (64, 64)
    assert not (samples / "grid.png").exists()  # one image: no grid
