"""A release lives in one committed file, and the alerts wait for their switch (deploy/check).

A value passed with `terraform apply -var NAME=…` lasts one apply: the next ordinary apply (adding
an operator, say) reads terraform.tfvars and release.auto.tfvars again and puts the older value
back, the producer on an older image against a newer schema, or its schedule paused again. So
the variables a release changes are set in terraform/release.auto.tfvars (committed; Terraform
loads it on every plan and apply), and this check holds that together:

- every variable release.auto.tfvars sets is declared with no default (the file is its only
  source) and is not set in terraform.tfvars.example (a second source that would win or confuse);
- no document step (deploy/README.md, README.md, ARCHITECTURE.md, docs/*.md) sets a release
  variable with -var;
- every google_monitoring_alert_policy exists only with alerts_enabled (its count or for_each
  reads var.alerts_enabled, or it iterates a module given `enabled = var.alerts_enabled`), so the
  first apply, before the dispatcher runs and the schema exists, pages nobody for nothing;
- every policy that notifies alert_notification_channels refuses the plan when that list is empty
  (unless allow_alerts_without_notification).

Usage: release_rules.py REPO               the check
       release_rules.py --self-test REPO   the check run on broken copies, each of which it must refuse
"""

import glob
import re
import shutil
import tempfile
from pathlib import Path

import hcl2

import selfcheck

RELEASE_FILE = "deploy/terraform/release.auto.tfvars"
SWITCH = "${var.alerts_enabled}"
PAGE_ROUTE = "${var.alert_notification_channels}"
# A -var on a terraform command line: -var NAME=…, -var=NAME=…, -var 'NAME=…', -var="NAME=…".
DASH_VAR = re.compile(r"""-var(?:=|\s+)["']?([A-Za-z_][A-Za-z0-9_]*)=""")


def one(v):
    """python-hcl2 wraps attribute values in a list."""
    return v[0] if isinstance(v, list) and len(v) == 1 else v


def unquote(s: str) -> str:
    return s.strip('"')


def documents(repo: Path) -> list[Path]:
    names = ["deploy/README.md", "README.md", "ARCHITECTURE.md"]
    found = [repo / n for n in names if (repo / n).exists()]
    return found + sorted(Path(p) for p in glob.glob(str(repo / "docs/**/*.md"), recursive=True))


def blocks(tf_dir: Path, kind: str) -> dict[str, dict]:
    """Top-level blocks of one kind in the root module: 'TYPE.NAME' (resources) or 'NAME'."""
    out = {}
    for path in sorted(tf_dir.glob("*.tf")):
        for block in hcl2.loads(path.read_text()).get(kind, []):
            for k, v in block.items():
                if kind == "resource":
                    for name, body in v.items():
                        out[f"{unquote(k)}.{unquote(name)}"] = body
                else:
                    out[unquote(k)] = v
    return out


def check(repo: Path) -> tuple[list[str], str]:
    tf = repo / "deploy/terraform"
    problems = []
    release = {k: one(v) for k, v in hcl2.loads((repo / RELEASE_FILE).read_text()).items()
               if not k.startswith("__")}
    for want in ("producer_image", "producer_schedule_paused", "alerts_enabled"):
        if want not in release:
            problems.append(f"{RELEASE_FILE} does not set {want}")
    variables = blocks(tf, "variable")
    for name in release:
        if name not in variables:
            problems.append(f"{RELEASE_FILE} sets {name}, which variables.tf does not declare")
        elif "default" in variables[name]:
            problems.append(f"variable {name} has a default: a release variable's only source is {RELEASE_FILE}")
    example = hcl2.loads((tf / "terraform.tfvars.example").read_text())
    for name in sorted(set(example) & set(release)):
        problems.append(f"terraform.tfvars.example sets the release variable {name} (it belongs in {RELEASE_FILE})")

    docs = documents(repo)
    for doc in docs:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for name in DASH_VAR.findall(line):
                if name in release:
                    problems.append(f"{doc.relative_to(repo)}:{n}: sets the release variable {name} with -var "
                                    f"(the next apply without it puts the old value back): change {RELEASE_FILE} "
                                    "and apply")

    modules = blocks(tf, "module")
    policies = {k: v for k, v in blocks(tf, "resource").items() if k.startswith("google_monitoring_alert_policy.")}
    if not policies:
        problems.append("no google_monitoring_alert_policy found")
    for name, body in policies.items():
        gate = str(one(body.get("count", ""))) + str(one(body.get("for_each", "")))
        m = re.fullmatch(r"\$\{module\.(\w+)\.\w+\}", str(one(body.get("for_each", ""))))
        switched = "var.alerts_enabled" in gate or (
            m is not None and one(modules.get(m.group(1), {}).get("enabled")) == SWITCH)
        if not switched:
            problems.append(f"{name}: alert policy enabled without the alerts_enabled switch (its count or "
                            "for_each must read var.alerts_enabled, or its module take enabled = var.alerts_enabled)")
        if one(body.get("notification_channels")) == PAGE_ROUTE:
            conditions = [str(one(p.get("condition"))) for lc in body.get("lifecycle", [])
                          for p in lc.get("precondition", [])]
            if not any("length(var.alert_notification_channels)" in c for c in conditions):
                problems.append(f"{name}: pages alert_notification_channels without the precondition that "
                                "refuses an empty list")
    return problems, (f"{len(release)} release variables, set in {RELEASE_FILE} only, none with -var in "
                      f"{len(docs)} documents; {len(policies)} alert policies behind alerts_enabled, the "
                      "paging ones refusing no channel")


# ---- the self-test: copies the check must refuse ------------------------------------------------

def mutations():
    """(what, file, edit, expected problem) — each edit must make the check fail that way."""
    readme, tf = "deploy/README.md", "deploy/terraform/monitoring.tf"

    def append(line):
        return lambda text: text + "\n" + line + "\n"

    def block(text, header):
        start = text.index(header)
        end = text.index("\n}\n", start) + 3
        return start, end

    def ungate(name):
        def edit(text):
            a, b = block(text, f'resource "google_monitoring_alert_policy" "{name}"')
            return text[:a] + text[a:b].replace("count = var.alerts_enabled ? 1 : 0", "") + text[b:]
        return edit

    def no_precondition(text):
        a, b = block(text, 'resource "google_monitoring_alert_policy" "cloudsql_health"')
        part = re.sub(r"\n  lifecycle \{.*?\n  \}\n", "\n", text[a:b], flags=re.S)
        return text[:a] + part + text[b:]

    return [
        ("the release step of 20ab8c0 (a -var release)", readme,
         append("   then `terraform apply -var producer_image=…/producer@sha256:…` (the next tick uses it)."),
         "sets the release variable producer_image with -var"),
        ("the first deploy's step 7 of 20ab8c0", readme,
         append("7. **Start the producer.** `terraform apply -var producer_schedule_paused=false`, or run it"),
         "sets the release variable producer_schedule_paused with -var"),
        ("the dispatcher's policies without the switch (the module of 20ab8c0)", tf,
         lambda t: t.replace("  enabled = var.alerts_enabled\n", "", 1), "without the alerts_enabled switch"),
        ("the database's policy always on (as on 20ab8c0)", tf, ungate("cloudsql_health"),
         "google_monitoring_alert_policy.cloudsql_health: alert policy enabled without the alerts_enabled switch"),
        ("the database's policy without the empty-channel precondition (as on 20ab8c0)", tf, no_precondition,
         "cloudsql_health: pages alert_notification_channels without the precondition"),
        ("producer_image back in terraform.tfvars.example", "deploy/terraform/terraform.tfvars.example",
         append('producer_image = "r/producer@sha256:' + "0" * 64 + '"'), "terraform.tfvars.example sets"),
        ("producer_schedule_paused with a default (as on 20ab8c0)", "deploy/terraform/variables.tf",
         lambda t: t.replace("true until the first migration has run (release.auto.tfvars).\"\n  type        = bool\n",
                             "true until the first migration has run (release.auto.tfvars).\"\n  type        = bool\n"
                             "  default     = false\n", 1),
         "variable producer_schedule_paused has a default"),
    ]


def self_test(repo: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp)
        files = [RELEASE_FILE] + [str(p.relative_to(repo)) for p in documents(repo)]
        files += [str(p.relative_to(repo)) for p in (repo / "deploy/terraform").glob("*.tf")]
        files.append("deploy/terraform/terraform.tfvars.example")

        def reset():
            for f in files:
                (copy / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(repo / f, copy / f)

        failures = []
        reset()
        problems, _ = check(copy)
        if problems:
            failures.append("the unchanged copy is refused: " + "; ".join(problems))
        for what, file, edit, expected in mutations():
            reset()
            path = copy / file
            edited = edit(path.read_text())
            if edited == path.read_text():
                failures.append(f"{what}: the edit changed nothing (the self-test is out of date)")
                continue
            path.write_text(edited)
            problems, _ = check(copy)
            failures += selfcheck.not_refused(what, problems, expected)
    selfcheck.finish(failures, f"refuses {len(mutations())} broken copies (a -var release step and alert policies on without "
                     "the switch among them)")


if __name__ == "__main__":
    selfcheck.main(check, self_test)
