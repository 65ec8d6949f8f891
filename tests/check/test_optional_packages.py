"""An optimizer whose package is missing is refused before anything starts: `raytuner train`
and `run` exit 2 naming the package (``jobcheck/machine.py``), in a process where the
package cannot be imported, and no Ray starts. (`check` and `plan` on a job with 8-bit AdamW:
tests/plan/test_plan.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CODE = """
import json, sys
sys.modules["bitsandbytes"] = None  # import bitsandbytes: ImportError, find_spec: None
sys.modules["prodigyopt"] = None
from raytuner.cli import main

job, out = sys.argv[1], sys.argv[2]
where = ["--set", f"train.output={out!r}", "--set", f"data.cache={out + '/cache'!r}"]
codes = {}
for command, optimizer in (("train", "adamw8bit"), ("run", "prodigy")):
    args = [command, job, *where, "--set", f"train.optimizer={optimizer!r}"]
    codes[f"{command} {optimizer}"] = main(args)
ray = sys.modules.get("ray")
codes["ray started"] = bool(ray is not None and ray.is_initialized())
print("codes:", json.dumps(codes))
"""


def test_a_missing_optimizer_package_is_refused_naming_it(tmp_path):
    job = REPO / "jobs" / "tiny.toml"
    result = subprocess.run(
        [sys.executable, "-c", CODE, str(job), str(tmp_path / "out")],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    printed = [line for line in result.stdout.splitlines() if line.startswith("codes: ")]
    assert printed, result.stdout[-3000:]
    codes = json.loads(printed[-1].removeprefix("codes: "))
    expected = {"train adamw8bit": 2, "run prodigy": 2, "ray started": False}
    assert codes == expected, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("raytuner:")]
    hint = "pip install 'raytuner[lowvram]', or use adamw or adafactor"
    assert lines == [
        f"raytuner: config error: {job}: train.optimizer = 'adamw8bit' needs the bitsandbytes "
        f"package: {hint}",
        f"raytuner: config error: {job}: train.optimizer = 'prodigy' needs the prodigyopt "
        f"package: {hint}",
    ], result.stderr[-3000:]
    assert not (tmp_path / "out").exists()  # nothing written
