"""A release lives in one committed file per environment, and the alerts wait for their switch
(deploy/check).

A value passed with `terraform apply -var NAME=…` (or `-var-file=…`, or `TF_VAR_NAME=…` in the
shell) lasts one apply: the next ordinary apply (adding an operator, say) reads the committed files
again and puts the older value back, the producer on an older image against a newer schema, or its
schedule paused again. So the variables a release changes are set in each environment's
terraform/environments/ENV/release.auto.tfvars (committed; Terraform loads it on every plan and
apply there), and this check holds that together, for every environment:

- release.auto.tfvars sets every release variable (RELEASE); each is declared with no default in
  the environment's variables.tf and in the module (the file is its only source), and the
  environment's module call passes it on unchanged (`NAME = var.NAME`, no literal);
- no other .tfvars file sits in the environment's directory (a second source, read or not);
- no document step (deploy/README.md, README.md, ARCHITECTURE.md, docs/*.md) sets a release
  variable with -var or TF_VAR_NAME=, or gives terraform a -var-file;
- every google_monitoring_alert_policy of the module exists only with alerts_enabled (its count or
  for_each reads var.alerts_enabled, or it iterates a module given `enabled = var.alerts_enabled`),
  so the first apply, before the dispatcher runs and the schema exists, pages nobody for nothing;
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

TERRAFORM = "deploy/terraform"
MODULE = f"{TERRAFORM}/modules/pubsub-outbox"
ENVIRONMENTS = f"{TERRAFORM}/environments"
RELEASE_FILE = "release.auto.tfvars"
# What a release changes: set in each environment's release.auto.tfvars, nowhere else.
RELEASE = ("producer_image", "cloud_sql_proxy_image", "producer_schedule_paused", "alerts_enabled")
SWITCH = "${var.alerts_enabled}"
PAGE_ROUTE = "${var.alert_notification_channels}"
# A -var on a terraform command line: -var NAME=…, -var=NAME=…, -var 'NAME=…', -var="NAME=…".
DASH_VAR = re.compile(r"""-var(?:=|\s+)["']?([A-Za-z_][A-Za-z0-9_]*)=""")
# A variable from the environment: TF_VAR_NAME=… (export, env, or before the command).
TF_VAR = re.compile(r"""\bTF_VAR_([A-Za-z_][A-Za-z0-9_]*)=""")
# A variables file given on the command line: -var-file=F, -var-file F (a second source of values).
VAR_FILE = re.compile(r"""-var-file(?:=|\s+)["']?[\w./~$-]""")


def one(v):
    """python-hcl2 wraps attribute values in a list."""
    return v[0] if isinstance(v, list) and len(v) == 1 else v


def unquote(s: str) -> str:
    return s.strip('"')


def documents(repo: Path) -> list[Path]:
    names = ["deploy/README.md", "README.md", "ARCHITECTURE.md"]
    found = [repo / n for n in names if (repo / n).exists()]
    return found + sorted(Path(p) for p in glob.glob(str(repo / "docs/**/*.md"), recursive=True))


def environments(repo: Path) -> list[Path]:
    return sorted(p for p in (repo / ENVIRONMENTS).glob("*") if p.is_dir())


def blocks(tf_dir: Path, kind: str) -> dict[str, dict]:
    """Top-level blocks of one kind in a directory: 'TYPE.NAME' (resources) or 'NAME'."""
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


def environment_problems(repo: Path, env: Path, module_vars: dict) -> list[str]:
    name = env.relative_to(repo)
    release_path = env / RELEASE_FILE
    if not release_path.exists():
        return [f"{name}: no {RELEASE_FILE} (the environment's release)"]
    problems = []
    release = {k: one(v) for k, v in hcl2.loads(release_path.read_text()).items() if not k.startswith("__")}
    for want in RELEASE:
        if want not in release:
            problems.append(f"{name}/{RELEASE_FILE} does not set {want}")
    for other in sorted(p.name for p in env.iterdir() if p.name != RELEASE_FILE and
                        (p.name.endswith(".tfvars") or p.name.endswith(".tfvars.json"))):
        problems.append(f"{name}/{other}: a second source of values beside {RELEASE_FILE}: put settings in main.tf, "
                        f"the release in {RELEASE_FILE}")
    variables = blocks(env, "variable")
    call = blocks(env, "module").get("pubsub_outbox", {})
    for var in sorted(set(release) | set(RELEASE)):
        if var not in variables:
            problems.append(f"{name}: {RELEASE_FILE} sets {var}, which its variables.tf does not declare")
        elif "default" in variables[var]:
            problems.append(f"{name}: variable {var} has a default: a release variable's only source is {RELEASE_FILE}")
        if var not in module_vars:
            problems.append(f"{name}: {var} is no variable of {MODULE}")
        elif "default" in module_vars[var]:
            problems.append(f"{MODULE}: variable {var} has a default: a release variable's only source is each "
                            f"environment's {RELEASE_FILE}")
        if str(one(call.get(var, ""))) != f"${{var.{var}}}":
            problems.append(f"{name}: its module call does not pass {var} = var.{var} (the release is "
                            f"{RELEASE_FILE}'s, nothing else)")
    return problems


def check(repo: Path) -> tuple[list[str], str]:
    module = repo / MODULE
    module_vars = blocks(module, "variable")
    envs = environments(repo)
    problems = [] if envs else [f"no environment under {ENVIRONMENTS}"]
    for env in envs:
        problems += environment_problems(repo, env, module_vars)

    docs = documents(repo)
    for doc in docs:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            where = f"{doc.relative_to(repo)}:{n}"
            for var in DASH_VAR.findall(line):
                if var in RELEASE:
                    problems.append(f"{where}: sets the release variable {var} with -var (the next apply without "
                                    f"it puts the old value back): change the environment's {RELEASE_FILE} and apply")
            for var in TF_VAR.findall(line):
                if var in RELEASE:
                    problems.append(f"{where}: sets the release variable {var} with TF_VAR_{var}= (the next apply "
                                    f"without it puts the old value back): change the environment's {RELEASE_FILE}")
            if VAR_FILE.search(line):
                problems.append(f"{where}: gives terraform a -var-file (a second source that the next apply "
                                f"without it does not read): settings go in main.tf, the release in {RELEASE_FILE}")

    modules = blocks(module, "module")
    policies = {k: v for k, v in blocks(module, "resource").items() if k.startswith("google_monitoring_alert_policy.")}
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
    return problems, (f"{len(RELEASE)} release variables, set only in the {RELEASE_FILE} of each of "
                      f"{len(envs)} environments ({', '.join(e.name for e in envs)}), none with -var, -var-file or "
                      f"TF_VAR_ in {len(docs)} documents; {len(policies)} alert policies behind alerts_enabled, "
                      "the paging ones refusing no channel")


# ---- the self-test: copies the check must refuse ------------------------------------------------

def mutations():
    """(what, file, edit, expected problem) — each edit must make the check fail that way."""
    readme, tf = "deploy/README.md", f"{MODULE}/monitoring.tf"
    staging = f"{ENVIRONMENTS}/staging"

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

    def with_default(description):
        return lambda t: t.replace(f'{description}"\n  type        = bool\n',
                                   f'{description}"\n  type        = bool\n  default     = false\n', 1)

    digest = "r/producer@sha256:" + "1" * 64
    return [
        ("the release step of 20ab8c0 (a -var release)", readme,
         append("   then `terraform apply -var producer_image=…/producer@sha256:…` (the next tick uses it)."),
         "sets the release variable producer_image with -var"),
        ("the first deploy's step 7 of 20ab8c0", readme,
         append("7. **Start the producer.** `terraform apply -var producer_schedule_paused=false`, or run it"),
         "sets the release variable producer_schedule_paused with -var"),
        ("a release step through the environment (TF_VAR_)", readme,
         append("   `TF_VAR_producer_image=…/producer@sha256:… terraform -chdir=deploy/terraform/environments/production apply`"),
         "sets the release variable producer_image with TF_VAR_producer_image="),
        ("a release step with a variables file (-var-file)", "docs/operating.md",
         append("   `terraform -chdir=deploy/terraform/environments/production apply -var-file=hotfix.tfvars`"),
         "gives terraform a -var-file"),
        ("the dispatcher's policies without the switch (the module of 20ab8c0)", tf,
         lambda t: t.replace("  enabled = var.alerts_enabled\n", "", 1), "without the alerts_enabled switch"),
        ("the database's policy always on (as on 20ab8c0)", tf, ungate("cloudsql_health"),
         "google_monitoring_alert_policy.cloudsql_health: alert policy enabled without the alerts_enabled switch"),
        ("the database's policy without the empty-channel precondition (as on 20ab8c0)", tf, no_precondition,
         "cloudsql_health: pages alert_notification_channels without the precondition"),
        ("producer_image written into staging's module call", f"{staging}/main.tf",
         lambda t: t.replace("producer_image           = var.producer_image",
                             f'producer_image           = "{digest}"', 1),
         "does not pass producer_image = var.producer_image"),
        ("a terraform.tfvars beside staging's release (the apply of an older checkout)",
         f"{staging}/terraform.tfvars", lambda t: t + f'producer_image = "{digest}"\n', "a second source of values"),
        ("producer_schedule_paused with a default in the module (as on 20ab8c0)", f"{MODULE}/variables.tf",
         with_default("true until the first migration has run (release.auto.tfvars)."),
         "variable producer_schedule_paused has a default"),
        ("alerts_enabled with a default in staging's variables.tf", f"{staging}/variables.tf",
         with_default("Make the alert policies (release.auto.tfvars)."), "variable alerts_enabled has a default"),
    ]


def self_test(repo: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp)
        files = [str(p.relative_to(repo)) for p in documents(repo)]
        files += [str(p.relative_to(repo)) for p in (repo / MODULE).glob("*.tf")]
        for env in environments(repo):
            files += [str(p.relative_to(repo)) for p in env.iterdir()
                      if p.is_file() and (p.suffix in (".tf", ".tfvars") or p.name == "streams.toml")]

        def reset():
            shutil.rmtree(copy / ENVIRONMENTS, ignore_errors=True)
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
            before = path.read_text() if path.exists() else ""
            edited = edit(before)
            if edited == before:
                failures.append(f"{what}: the edit changed nothing (the self-test is out of date)")
                continue
            path.write_text(edited)
            problems, _ = check(copy)
            failures += selfcheck.not_refused(what, problems, expected)
    selfcheck.finish(failures, f"refuses {len(mutations())} broken copies (-var, -var-file and TF_VAR_ release steps, "
                     "a second source beside release.auto.tfvars and alert policies on without the switch among them)")


if __name__ == "__main__":
    selfcheck.main(check, self_test)
