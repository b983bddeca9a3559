"""Every paging alert of the dispatcher reaches someone (deploy/check).

The alert rules live in k8s/alerts.yaml, a Google Managed Prometheus `Rules` resource, which sends
only to an Alertmanager that nothing in deploy/ configures. What pages is a Cloud Monitoring policy
per alert that Terraform makes from that same file (terraform/modules/dispatcher_alerts/ reads
it, terraform/modules/pubsub-outbox/monitoring.tf makes the policies). This check holds the two together:

- every alerting rule has `severity: page` or `warning`; the paging ones include at least PAGING;
  its `description` is plain text (it becomes the policy's documentation, where {{ }} templates
  are not expanded) and its `runbook` names a heading of docs/operating.md that exists;
- every series selector of an alert carries job="pubsub-outbox-dispatcher" (what Terraform turns
  into the install's project_id, cluster and namespace matchers), and every aggregation and
  vector matching keeps `cluster` and `namespace`, so one alert is one install;
- the module, evaluated offline with `terraform console` (it has no provider), scopes every
  selector of every query to the project, cluster and namespace it is given, and the pubsub-outbox
  module gives it k8s/alerts.yaml (its rules_file resolves to that file);
- every paging alert is routed: a google_monitoring_alert_policy whose for_each is the module's
  output holding the alert, whose condition runs its query, and whose notification_channels are
  var.alert_notification_channels.

Usage: alert_routes.py REPO               the check
       alert_routes.py --self-test REPO   the check run on broken copies, each of which it must refuse
"""

import base64
import glob
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import hcl2
import promql_parser
import yaml

import selfcheck

# The alerts that must page (issue #36): without any of these, an outage goes unnoticed.
PAGING = {"OutboxDispatcherAbsent", "OutboxNotPublishing", "OutboxBacklogAgeCritical",
          "OutboxOrderingKeyBlocked", "OutboxBreakerOpen"}
SEVERITIES = {"page", "warning"}
JOB = "pubsub-outbox-dispatcher"
ROUTE = "${var.alert_notification_channels}"
MODULES = "deploy/terraform/modules"
# What the module is evaluated with: every selector of its queries must end up with these.
SCOPE = {"project_id": "check-project", "cluster": "check-cluster", "namespace": "check-namespace"}


def one(v):
    """python-hcl2 wraps attribute values in a list."""
    return v[0] if isinstance(v, list) and len(v) == 1 else v


def unquote(s: str) -> str:
    return s.strip('"')


def nodes(expr):
    """Every node of a parsed PromQL expression."""
    yield expr
    for attr in ("expr", "lhs", "rhs", "vector_selector", "param"):
        child = getattr(expr, attr, None)
        if child is not None and type(child).__module__.startswith("promql"):
            yield from nodes(child)
    for child in getattr(expr, "args", None) or []:
        yield from nodes(child)


def selectors(expr):
    return [n for n in nodes(expr) if type(n).__name__ == "VectorSelector"]


def equal_matchers(selector) -> dict:
    return {m.name: m.value for m in selector.matchers.matchers if str(m.op).endswith("Equal")
            and not str(m.op).endswith("NotEqual")}


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors."""
    found = set()
    for title in re.findall(r"^#+\s+(.*?)\s*$", markdown, re.M):
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").lower()).replace(" ", "-")
        found.add(slug)
    return found


def rule_problems(rules: list, operating: str) -> list[str]:
    """The rules themselves: severity, plain description, runbook, scope."""
    problems = []
    headings = anchors(operating)
    for r in rules:
        name = r["alert"]
        severity = r.get("labels", {}).get("severity")
        if severity not in SEVERITIES:
            problems.append(f"{name}: severity {severity!r} is neither page nor warning")
        notes = r.get("annotations", {})
        if not notes.get("description") or "{{" in notes["description"]:
            problems.append(f"{name}: its description must be plain text (templates go in summary)")
        runbook = notes.get("runbook", "")
        path, _, anchor = runbook.partition("#")
        if path != "docs/operating.md" or anchor not in headings:
            problems.append(f"{name}: runbook {runbook!r} is no heading of docs/operating.md")
        try:
            expr = promql_parser.parse(r["expr"])
        except Exception as e:  # the parser raises its own types
            problems.append(f"{name}: does not parse: {e}")
            continue
        for s in selectors(expr):
            if equal_matchers(s).get("job") != JOB:
                problems.append(f"{name}: selector {s.name or s} lacks job=\"{JOB}\" (Terraform scopes "
                                "the query through it: without it the policy reads every install)")
        for n in nodes(expr):
            kind = type(n).__name__
            modifier = getattr(n, "modifier", None)
            if kind == "AggregateExpr":
                labels = set(modifier.labels) if modifier and str(modifier.type).endswith("By") else set()
                if not {"cluster", "namespace"} <= labels:
                    problems.append(f"{name}: `{n.op}` must aggregate by (cluster, namespace, …)")
            elif kind == "BinaryExpr" and modifier is not None and modifier.matching is not None:
                matching = modifier.matching
                if str(matching.type).endswith("Include") and not {"cluster", "namespace"} <= set(matching.labels):
                    problems.append(f"{name}: `on (…)` must keep cluster and namespace")
    paging = {r["alert"] for r in rules if r.get("labels", {}).get("severity") == "page"}
    for name in sorted(PAGING - paging):
        problems.append(f"{name}: must page (severity: page)")
    return problems


def evaluate(module_dir: Path, rules_file: Path, expression: str):
    """An expression of the module, evaluated offline by Terraform itself."""
    args = ["terraform", f"-chdir={module_dir}", "console", f"-var=rules_file={rules_file}"]
    args += [f"-var={k}={v}" for k, v in SCOPE.items()] + ["-var=enabled=true"]
    env = dict(os.environ, TF_CLI_CONFIG_FILE=os.devnull, TF_IN_AUTOMATION="1")
    run = subprocess.run(args, input=f"base64encode(jsonencode({expression}))\n", text=True,
                         capture_output=True, env=env, timeout=120)
    if run.returncode != 0:
        raise RuntimeError(f"terraform console in {module_dir}: {run.stderr.strip()}")
    return json.loads(base64.b64decode(run.stdout.strip().strip('"')))


def route_problems(repo: Path, rules: list) -> tuple[list[str], int]:
    """Terraform's side: the module's queries and the policies that notify."""
    problems = []
    tf = repo / MODULES / "pubsub-outbox"
    modules, policies = {}, {}
    for path in sorted(glob.glob(str(tf / "*.tf"))):
        doc = hcl2.loads(Path(path).read_text())
        for block in doc.get("module", []):
            modules |= {unquote(k): v for k, v in block.items()}
        for block in doc.get("resource", []):
            for kind, body in block.items():
                if unquote(kind) == "google_monitoring_alert_policy":
                    policies |= {unquote(k): v for k, v in body.items() if not k.startswith("__")}
    module = next(((n, m) for n, m in modules.items() if one(m["source"]) == "../dispatcher_alerts"), None)
    if module is None:
        return ["terraform: no module \"../dispatcher_alerts\" in modules/pubsub-outbox (the dispatcher's alerts "
                "reach nobody)"], 0
    module_name, module_args = module
    # ${path.module}/…: from the pubsub-outbox module's directory, it must reach deploy/k8s/alerts.yaml.
    rules_file = str(one(module_args.get("rules_file", ""))).replace("${path.module}", str(tf))
    if not rules_file.endswith("/k8s/alerts.yaml") or \
            Path(os.path.normpath(rules_file)) != (repo / "deploy/k8s/alerts.yaml"):
        problems.append(f"module {module_name}: rules_file must be deploy/k8s/alerts.yaml (one source for the "
                        f"rules), not {one(module_args.get('rules_file'))}")
    module_dir = repo / MODULES / "dispatcher_alerts"
    outputs = {}
    for block in hcl2.loads((module_dir / "main.tf").read_text()).get("output", []):
        for name, body in block.items():
            value = str(one(body["value"]))
            outputs[unquote(name)] = evaluate(module_dir, repo / "deploy/k8s/alerts.yaml", value[2:-1])

    # Every query the module makes reads this install only, and still parses.
    for output in outputs.values():
        for name, alert in output.items():
            try:
                expr = promql_parser.parse(alert["query"])
            except Exception as e:
                problems.append(f"{name}: the module's query does not parse: {e}")
                continue
            for s in selectors(expr):
                got = equal_matchers(s)
                if any(got.get(k) != v for k, v in SCOPE.items()):
                    problems.append(f"{name}: the module's query reads {s.name} beyond this install "
                                    f"(matchers {got})")

    routed = set()
    for name, body in policies.items():
        for_each = str(one(body.get("for_each", "")))
        channels = one(body.get("notification_channels"))
        query = [one(c.get("query")) for cond in body.get("conditions", [])
                 for c in cond.get("condition_prometheus_query_language", [])]
        m = re.fullmatch(r"\$\{module\.(\w+)\.(\w+)\}", for_each)
        if m and m.group(1) == module_name and channels == ROUTE and query == ["${each.value.query}"]:
            routed |= set(outputs.get(m.group(2), {}))
    paging = sorted(r["alert"] for r in rules if r.get("labels", {}).get("severity") == "page")
    for name in paging:
        if name not in routed:
            problems.append(f"{name} pages (severity: page) but no google_monitoring_alert_policy runs "
                            "its query with notification_channels = var.alert_notification_channels")
    return problems, len(paging)


def check(repo: Path) -> tuple[list[str], str]:
    rules = [r for d in yaml.safe_load_all((repo / "deploy/k8s/alerts.yaml").read_text()) if d
             for g in d["spec"]["groups"] for r in g["rules"] if "alert" in r]
    problems = rule_problems(rules, (repo / "docs/operating.md").read_text())
    routes, paging = route_problems(repo, rules)
    problems += routes
    return problems, f"{len(rules)} alerts; {paging} page, each through a Cloud Monitoring policy " \
                     "to alert_notification_channels, scoped to its install"


# ---- the self-test: copies the check must refuse ------------------------------------------------

def block_of(text: str, header: str) -> tuple[int, int]:
    """The span of a top-level HCL block, from its header to the next top-level block."""
    start = text.index(header)
    nxt = re.search(r"^(resource|module|locals|output|variable|data) ", text[start + 1:], re.M)
    return start, start + 1 + nxt.start() if nxt else len(text)


def with_rule(text: str, selector: str, anchor: str) -> str:
    """alerts.yaml with one more paging rule at the end."""
    return text + f"""        - alert: OutboxSelfTest
          expr: max by (cluster, namespace) (outbox_backlog_rows{selector}) > 0
          labels:
            severity: page
          annotations:
            summary: a rule added by the self-test
            description: A rule added by the self-test.
            runbook: docs/operating.md#{anchor}
"""


def mutations():
    """(what, file, edit, expected problem) — each edit must make the check fail that way."""
    def unroute(text):
        a, b = block_of(text, 'resource "google_monitoring_alert_policy" "dispatcher_page"')
        return text[:a] + text[a:b].replace(ROUTE[2:-1], "var.alert_warning_notification_channels") + text[b:]

    def drop_policies(text):
        for name in ("dispatcher_page", "dispatcher_warning"):
            a, b = block_of(text, f'resource "google_monitoring_alert_policy" "{name}"')
            text = text[:a] + text[b:]
        return text

    def add_rule(selector, anchor):
        return lambda text: with_rule(text, selector, anchor)

    def relabel(text):
        a = text.index("- alert: OutboxBreakerOpen")
        return text[:a] + text[a:].replace("severity: page", "severity: critical", 1)

    tf, rules = f"{MODULES}/pubsub-outbox/monitoring.tf", "deploy/k8s/alerts.yaml"
    return [
        ("a paging policy notifying another list", tf, unroute, "no google_monitoring_alert_policy"),
        ("no dispatcher policy (the Terraform of 2847324)", tf, drop_policies, "no google_monitoring_alert_policy"),
        ("the rules file's path of before the module moved (deploy/terraform/k8s/alerts.yaml)", tf,
         lambda t: t.replace('"${path.module}/../../../k8s/alerts.yaml"', '"${path.module}/../k8s/alerts.yaml"', 1),
         "rules_file must be deploy/k8s/alerts.yaml"),
        ("OutboxBreakerOpen labelled critical (the rules of 2847324)", rules, relabel, "neither page nor warning"),
        ("a paging rule whose selector has no job matcher", rules, add_rule("", "outboxbreakeropen"), "lacks job="),
        ("a paging rule whose runbook is no heading", rules,
         add_rule(f'{{job="{JOB}"}}', "no-such-section"), "is no heading"),
    ]


def self_test(repo: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp)
        shutil.copytree(repo / MODULES, copy / MODULES,
                        ignore=shutil.ignore_patterns(".terraform*", "*.tfstate*", "*.tfvars"))
        (copy / "deploy/k8s").mkdir(parents=True)
        (copy / "docs").mkdir()
        failures = []

        def reset():
            shutil.copy(repo / MODULES / "pubsub-outbox/monitoring.tf", copy / MODULES / "pubsub-outbox/monitoring.tf")
            shutil.copy(repo / "deploy/k8s/alerts.yaml", copy / "deploy/k8s/alerts.yaml")
            shutil.copy(repo / "docs/operating.md", copy / "docs/operating.md")

        reset()
        problems, summary = check(copy)
        if problems:
            failures.append("the unchanged copy is refused: " + "; ".join(problems))
        paging = int(re.search(r"; (\d+) page", summary).group(1))
        # A valid paging rule added to alerts.yaml needs no Terraform edit: the same for_each routes it.
        reset()
        path = copy / "deploy/k8s/alerts.yaml"
        path.write_text(with_rule(path.read_text(), f'{{job="{JOB}"}}', "outboxbreakeropen"))
        problems, summary = check(copy)
        if problems or f"; {paging + 1} page" not in summary:
            failures.append(f"a valid new paging rule is not routed by itself: {problems or summary}")
        for what, file, edit, expected in mutations():
            reset()
            path = copy / file
            path.write_text(edit(path.read_text()))
            problems, _ = check(copy)
            failures += selfcheck.not_refused(what, problems, expected)
    selfcheck.finish(failures, f"refuses {len(mutations())} broken copies (an unrouted paging alert among them); "
                     "routes a new paging rule with no Terraform edit")


if __name__ == "__main__":
    selfcheck.main(check, self_test)
