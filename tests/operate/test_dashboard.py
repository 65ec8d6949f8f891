"""The Grafana dashboard (cluster/grafana/raytuner-dashboard.json) shows every metric raytuner
emits and no other: the metrics are declared in raytuner/observe/metrics.py (``gauge`` and ``count``
refuse an undeclared name), every declared one is emitted somewhere in the code, every emitted
literal name is declared, the dashboard's queries name exactly their Prometheus series (as Ray's
own exporter names them), and a dashboard missing a panel, or naming a series nobody emits, is
refused."""

from __future__ import annotations

import ast
import copy
import json
from pathlib import Path

import pytest
from cluster_grafana import dashboard_problems, series

from raytuner.observe import metrics

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "cluster" / "grafana" / "raytuner-dashboard.json"


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _string_constants() -> tuple[set[str], set[str]]:
    """(every string constant in raytuner/ outside metrics.py, the literal names passed to
    ``metrics.gauge`` / ``metrics.count``)."""
    strings, emitted = set(), set()
    for path in (REPO / "raytuner").rglob("*.py"):
        if path.name == "metrics.py" and path.parent.name == "observe":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("gauge", "count")
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "metrics"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                emitted.add(node.args[0].value)
    return strings, emitted


def test_the_dashboard_shows_exactly_the_emitted_metrics():
    doc = _dashboard()
    assert dashboard_problems(doc) == []
    assert series(doc) == metrics.exported()
    assert "ray_raytuner_train_loss" in series(doc)
    assert "ray_raytuner_images_encoded_total" in series(doc)  # a counter: Prometheus' _total


def test_the_series_names_are_those_rays_exporter_gives():
    """Ray's own OpenTelemetry recorder (what the metrics agent serves to Prometheus) turns each
    declared metric into the series name the dashboard queries."""
    from prometheus_client import REGISTRY, generate_latest
    from ray._private.telemetry.open_telemetry_metric_recorder import OpenTelemetryMetricRecorder

    recorder = OpenTelemetryMetricRecorder()
    for name in metrics.GAUGES:
        recorder.register_gauge_metric(name, metrics.GAUGES[name])
    for name in metrics.COUNTERS:
        recorder.register_counter_metric(name, metrics.COUNTERS[name])
    for name in metrics.GAUGES | metrics.COUNTERS:
        recorder.set_metric_value(name, {"run": "dashboard-test"}, 1.0)
    scraped = generate_latest(REGISTRY).decode().splitlines()
    names = {line.split("{")[0] for line in scraped if 'run="dashboard-test"' in line}
    assert names == metrics.exported() == series(_dashboard())


def test_every_declared_metric_is_emitted_and_every_emitted_one_declared():
    strings, emitted = _string_constants()
    declared = set(metrics.GAUGES) | set(metrics.COUNTERS)
    assert emitted <= declared, f"emitted but not declared: {sorted(emitted - declared)}"
    assert declared <= strings, f"declared but never emitted: {sorted(declared - strings)}"
    with pytest.raises(ValueError, match="not declared: add it to GAUGES or COUNTERS"):
        metrics.gauge("raytuner_train_made_up", 1.0, "run")
    with pytest.raises(ValueError, match="raytuner-dashboard.json"):
        metrics.count("raytuner_made_up", 1, "run")


def test_a_dashboard_missing_a_metric_or_naming_another_is_refused():
    doc = _dashboard()
    loss = next(p for p in doc["panels"] if "ray_raytuner_train_loss" in json.dumps(p))
    without = copy.deepcopy(doc)
    without["panels"] = [p for p in without["panels"] if p["id"] != loss["id"]]
    assert "no panel shows ray_raytuner_train_loss (raytuner emits it)" in dashboard_problems(
        without
    )
    renamed = json.loads(json.dumps(doc).replace("images_encoded_total", "images_encoded"))
    problems = dashboard_problems(renamed)
    assert "ray_raytuner_images_encoded is not a series raytuner emits" in problems
    broken = copy.deepcopy(doc)
    broken["panels"][1]["targets"][0].pop("expr")
    assert any("needs an expr" in p for p in dashboard_problems(broken))
