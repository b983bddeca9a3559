"""The Cloud Monitoring dashboard and the alert rules name only metrics that exist (deploy/check).

- terraform/modules/pubsub-outbox/dashboard.json is JSON with a mosaic layout whose tiles fit its
  columns without overlapping, each a titled chart or scorecard with at least one query, and no
  tile states a position of 0 (the API leaves it out, so an explicit 0 diffs on every plan);
- every dashboard PromQL selector reads this install only (project_id, cluster and namespace matchers);
- every PromQL query (dashboard and k8s/alerts.yaml) parses, and each `outbox_…` series it reads
  is one the dispatcher exports: a name registered in dispatcher/src/metrics.rs, with the suffix
  its type gets (counter `_total`; histogram `_bucket`, `_sum`, `_count`; gauge none), or a
  recording rule of alerts.yaml;
- every Cloud Monitoring filter names a Cloud Run job metric or the logs-based metric of
  that module's monitoring.tf, and every template variable is one monitoring.tf passes.

Usage: dashboard_check.py REPO
"""

import json
import re
import sys
from pathlib import Path

import promql_parser
import yaml

SERIES = re.compile(r"\b(outbox_[a-z0-9_]+)\b")


def exported(metrics_rs: str) -> set[str]:
    """The series names the dispatcher's registry writes."""
    kinds = {}
    for field, ty in re.findall(r"^\s*pub (\w+): (.+),$", metrics_rs, re.M):
        kinds[field] = "histogram" if "Histogram" in ty else "counter" if "Counter" in ty else "gauge"
    names = set()
    registrations = re.findall(
        r'register\(\s*"(\w+)",\s*"(?:[^"\\]|\\.)*",\s*(?:m\.|self\.)?(\w+)', metrics_rs
    )
    if not registrations:
        sys.exit("no registrations found in dispatcher/src/metrics.rs")
    for name, value in registrations:
        kind = kinds.get(value, "gauge")  # a local (build_info) is a gauge family
        full = f"outbox_{name}"
        if kind == "counter":
            names.add(f"{full}_total")
        elif kind == "histogram":
            names |= {f"{full}_bucket", f"{full}_sum", f"{full}_count"}
        else:
            names.add(full)
    return names


def queries(node, found):
    """Every prometheusQuery and timeSeriesFilter of a dashboard node."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "prometheusQuery":
                found["promql"].append(v)
            elif k == "timeSeriesFilter":
                found["filters"].append(v["filter"])
            else:
                queries(v, found)
    elif isinstance(node, list):
        for v in node:
            queries(v, found)


def layout(dashboard) -> list[str]:
    problems = []
    mosaic = dashboard.get("mosaicLayout")
    if not mosaic or not dashboard.get("displayName"):
        return ["the dashboard needs a displayName and a mosaicLayout"]
    cols, cells = mosaic["columns"], {}
    for i, tile in enumerate(mosaic["tiles"]):
        widget = tile["widget"]
        title = widget.get("title") or f"tile {i}"
        if not widget.get("title"):
            problems.append(f"{title}: no title")
        if not (set(widget) & {"xyChart", "scorecard"}):
            problems.append(f"{title}: neither a chart nor a scorecard")
        found = {"promql": [], "filters": []}
        queries(widget, found)
        if not found["promql"] and not found["filters"]:
            problems.append(f"{title}: no query")
        for k in ("xPos", "yPos"):
            if k in tile and tile[k] == 0:
                problems.append(f"{title}: {k} 0 is written out (the API omits it: a diff on every plan)")
        x, y, w, h = (tile.get(k, 0) for k in ("xPos", "yPos", "width", "height"))
        if x + w > cols or w <= 0 or h <= 0:
            problems.append(f"{title}: does not fit {cols} columns")
        for cx in range(x, x + w):
            for cy in range(y, y + h):
                if (cx, cy) in cells:
                    problems.append(f"{title}: overlaps {cells[(cx, cy)]}")
                    break
                cells[(cx, cy)] = title
            else:
                continue
            break
    return problems


def main() -> None:
    repo = Path(sys.argv[1])
    text = (repo / "deploy/terraform/modules/pubsub-outbox/dashboard.json").read_text()
    dashboard = json.loads(text)
    problems = layout(dashboard)
    names = exported((repo / "dispatcher/src/metrics.rs").read_text())

    rules = [r for d in yaml.safe_load_all((repo / "deploy/k8s/alerts.yaml").read_text()) if d
             for g in d["spec"]["groups"] for r in g["rules"]]
    names |= {r["record"] for r in rules if "record" in r}

    found = {"promql": [], "filters": []}
    queries(dashboard, found)
    promql = [("dashboard", q) for q in found["promql"]] + [("alerts.yaml", r["expr"]) for r in rules]
    used = set()
    for where, q in promql:
        try:
            promql_parser.parse(re.sub(r"\$\{\w+\}", "x", q))
        except Exception as e:  # the parser raises its own types
            problems.append(f"{where}: {q!r} does not parse: {e}")
        if where == "dashboard":
            # Cloud Monitoring sees every cluster of the project: each selector names this one.
            for selector in re.findall(r"\boutbox_\w+(\{(?:[^{}]|\$\{\w+\})*\})?", q):
                if any(m not in selector for m in ('project_id="${project_id}"', 'cluster="${cluster}"',
                                                     'namespace="${namespace}"')):
                    problems.append(f"dashboard: {q!r} reads a series without the project_id, cluster and "
                                    "namespace matchers")
                    break
        for series in SERIES.findall(q):
            used.add(series)
            if series not in names:
                problems.append(f"{where}: {series} is not a metric the dispatcher exports")

    monitoring = (repo / "deploy/terraform/modules/pubsub-outbox/monitoring.tf").read_text()
    call = re.search(r'templatefile\("\$\{path\.module\}/dashboard\.json",\s*\{(.*?)\}\)', monitoring, re.S)
    passed = set(re.findall(r"^\s*(\w+)\s*=", call.group(1), re.M)) if call else set()
    for var in set(re.findall(r"\$\{(\w+)\}", text)) - passed:
        problems.append(f"dashboard.json uses ${{{var}}}, which monitoring.tf does not pass")
    if "lag_metric" in passed and 'resource "google_logging_metric"' not in monitoring:
        problems.append("monitoring.tf defines no logs-based metric for lag_metric")
    for f in found["filters"]:
        kind = re.search(r'metric\.type="([^"]+)"', f)
        if not kind or not (kind.group(1).startswith("run.googleapis.com/job/")
                            or kind.group(1) == "logging.googleapis.com/user/${lag_metric}"):
            problems.append(f"filter {f!r}: neither a Cloud Run job metric nor the producer's lag metric")

    if problems:
        sys.exit("\n".join(problems))
    tiles = len(dashboard["mosaicLayout"]["tiles"])
    print(f"{tiles} tiles; {len(promql)} PromQL queries over {len(used)} exported series; "
          f"{len(found['filters'])} Cloud Monitoring filters")


if __name__ == "__main__":
    main()
