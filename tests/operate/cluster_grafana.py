"""Checks of the Grafana dashboard (cluster/grafana/raytuner-dashboard.json): the shape Grafana
imports (a titled dashboard with a uid, panels with a type, an id of their own and a place on
the grid, queries with a PromQL ``expr`` and a refId, the Prometheus data source picked through
the ``$datasource`` variable as in Ray's own dashboards), and the series its queries name are
exactly those raytuner emits (``observe/metrics.py``: every declared metric under its Prometheus
name, ``ray_`` in front and ``_total`` after a counter's name)."""

from __future__ import annotations

import re
from typing import Any

from raytuner.observe import metrics

SERIES = re.compile(r"\bray_raytuner_\w+")


def targets(doc: dict) -> list[dict]:
    return [t for p in doc.get("panels", []) for t in p.get("targets", [])]


def series(doc: dict) -> set[str]:
    """Every ``ray_raytuner_*`` series the dashboard's queries and variables name."""
    exprs = [t.get("expr", "") for t in targets(doc)]
    for v in doc.get("templating", {}).get("list", []):
        query = v.get("query")
        exprs.append(query.get("query", "") if isinstance(query, dict) else str(query or ""))
    return {name for e in exprs for name in SERIES.findall(e)}


def _panel_problems(panel: dict, ids: list) -> list[str]:
    where = f"panel {panel.get('id')} ({panel.get('title')!r})"
    problems = []
    if not panel.get("type") or not panel.get("title"):
        problems.append(f"{where}: needs a type and a title")
    if ids.count(panel.get("id")) != 1:
        problems.append(f"{where}: panel ids must be unique integers")
    if set(panel.get("gridPos", {})) != {"h", "w", "x", "y"}:
        problems.append(f"{where}: gridPos needs h, w, x and y")
    if panel.get("type") == "row":
        return problems
    if not panel.get("targets"):
        problems.append(f"{where}: no query (targets)")
    for t in panel.get("targets", []):
        if not t.get("expr") or not t.get("refId"):
            problems.append(f"{where}: every target needs an expr and a refId")
        if t.get("datasource", {}).get("uid") != "${datasource}":
            problems.append(f"{where}: targets must use the $datasource variable")
    return problems


def dashboard_problems(doc: Any) -> list[str]:
    if not isinstance(doc, dict) or not doc.get("title") or not doc.get("uid"):
        return ["not a Grafana dashboard (an object with a title, a uid and panels)"]
    problems = []
    variables = {v.get("name"): v for v in doc.get("templating", {}).get("list", [])}
    if variables.get("datasource", {}).get("query") != "prometheus":
        problems.append("a datasource variable of type prometheus is missing")
    ids = [p.get("id") for p in doc.get("panels", [])]
    if not all(isinstance(i, int) for i in ids):
        problems.append("panel ids must be integers")
    for panel in doc.get("panels", []):
        problems += _panel_problems(panel, ids)
    shown, emitted = series(doc), metrics.exported()
    problems += [f"no panel shows {name} (raytuner emits it)" for name in sorted(emitted - shown)]
    problems += [f"{name} is not a series raytuner emits" for name in sorted(shown - emitted)]
    return problems
