"""The import layers of raytuner/ (docs/architecture.md): read with ``ast``, every import of a
raytuner module (top-level or inside a function) must point to the same or a lower layer, and
no modules may import each other in a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "raytuner"

# lowest first: each layer is a list of the package's top-level folders and modules
LAYERS: list[tuple[str, list[str]]] = [
    (
        "foundation",
        [
            "version",
            "errors",
            "quiet",
            "quantizers",
            "storage",
            "checkpoint",
            "runtime",
            "config",
            "placement",
        ],
    ),
    ("reporting", ["observe"]),
    ("lora", ["lora"]),
    ("models", ["families"]),
    ("data", ["data"]),
    ("preprocess", ["preprocess"]),
    ("rendering", ["render"]),
    ("training", ["train"]),
    ("operations", ["tools"]),
    ("api", ["jobcheck", "api", "__init__"]),
    ("commands", ["cli", "cli_args", "demo", "__main__"]),
]


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" and len(rel.parts) > 1 else rel.parts
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer_of(name: str) -> int:
    """The layer of the module's top-level folder (or of the top-level module itself)."""
    top = name.split(".")[0]
    for i, (_, folders) in enumerate(LAYERS):
        if top in folders:
            return i
    raise AssertionError(f"raytuner.{name} is in no layer: add {top} to LAYERS and the docs")


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The raytuner modules ``name`` imports (``from raytuner import x`` names module x)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([p for p in up if p] + ([base] if base else []))
                base = f"raytuner.{base}" if base else "raytuner"
            named = [f"{base}.{a.name}" for a in node.names]
            # `from raytuner.x import y`: module x.y if there is one, else (a name in) x
            modules_named = [t for t in named if t.removeprefix("raytuner.") in known]
            targets = modules_named or [base]
        else:
            continue
        for target in targets:
            if target == "raytuner" or not target.startswith("raytuner."):
                continue
            dotted = target.removeprefix("raytuner.")
            while dotted and dotted not in known:
                dotted = dotted.rpartition(".")[0]
            if dotted and dotted != name:
                out.add(dotted)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_import_points_to_the_same_or_a_lower_layer():
    wrong = [
        f"raytuner.{a} ({LAYERS[layer_of(a)][0]}) imports raytuner.{b} ({LAYERS[layer_of(b)][0]})"
        for a, targets in sorted(graph().items())
        for b in sorted(targets)
        if layer_of(b) > layer_of(a)
    ]
    assert not wrong, "imports that run up the layers:\n" + "\n".join(wrong)


def test_no_import_cycles():
    edges, seen, done, cycles = graph(), set(), set(), []

    def visit(node: str, stack: list[str]) -> None:
        seen.add(node)
        for nxt in sorted(edges[node]):
            if nxt in stack:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in seen:
                visit(nxt, [*stack, nxt])
        done.add(node)

    for start in sorted(edges):
        if start not in seen:
            visit(start, [start])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_an_upward_import_and_a_cycle(tmp_path):
    """The two rules fail where they should (a fake package with a cycle and a lower layer
    importing a higher one)."""
    (tmp_path / "raytuner").mkdir()
    fake = {"storage": "from raytuner import cli\n", "cli": "import raytuner.storage\n"}
    for name, text in fake.items():
        (tmp_path / "raytuner" / f"{name}.py").write_text(text)
    known = {n: tmp_path / "raytuner" / f"{n}.py" for n in fake}
    edges = {n: imports(n, p, known) for n, p in known.items()}
    assert edges == {"storage": {"cli"}, "cli": {"storage"}}
    assert layer_of("storage") < layer_of("cli")


def test_every_layer_is_in_the_architecture_doc():
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    for name, folders in LAYERS:
        assert f"**{name}**" in doc, f"docs/architecture.md lacks layer {name}"
        for folder in folders:
            assert f"`{folder}" in doc, f"docs/architecture.md does not place {folder}"


def test_import_raytuner_gives_the_api_without_loading_torch():
    import subprocess
    import sys

    code = (
        "import sys, raytuner; assert 'torch' not in sys.modules; "
        "from raytuner import api; "
        "assert all(getattr(raytuner, n) is getattr(api, n) for n in raytuner.__all__); "
        "print(sorted(raytuner.__all__))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "'preprocess', 'run', 'sample', 'train'" in out.stdout
