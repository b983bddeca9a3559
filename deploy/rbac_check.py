"""The admin Role grants what a release and the admin scripts need, and nothing more (deploy/check).

The people on call hold the Role pubsub-outbox-admin-jobs (k8s/common/admin.yaml) in the admin
namespace, and with it they run a release's migration (delete the last Job, `kubectl apply -k` the
migrate entry point, migrate/wait), operator/run and bootstrap/run. Each kubectl call is one or
more API requests (a verb on a resource, by name or not); the Role must allow every one, or the
release stops on a Forbidden halfway. This check:

- reads the Role from the render of common, and the objects of the renders the holders apply in
  the admin namespace: migrate (each object applied), operator/run's and bootstrap/run's Jobs
  (as `--print` renders them);
- turns them, with CALLS (every kubectl call of the scripts, as each script writes it), into the
  requests they make, and fails on a request the Role does not allow;
- fails on a grant no request needs (a verb too many, a name no call uses, a named grant that a
  grant on every name already covers), so the Role stays exactly what is needed;
- fails when a script has a kubectl call CALLS does not list, or CALLS one the script no longer
  makes, and when migrate/wait waits for a Job that migrate does not render.

Usage: rbac_check.py [--self-test] COMMON --release MIGRATE --operator-run JOB... --bootstrap-run JOB
  (the render files; --self-test removes each verb of the Role in turn, adds pods/exec, and plants
  an unlisted kubectl call and an object migrate's apply cannot write: each must be refused)
"""

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

import selfcheck

NAMESPACE = "pubsub-outbox-admin"
ROLE = "pubsub-outbox-admin-jobs"
# kind -> (API group, resource) of the kinds the renders may hold.
KINDS = {
    "ConfigMap": ("", "configmaps"), "Secret": ("", "secrets"), "ServiceAccount": ("", "serviceaccounts"),
    "Pod": ("", "pods"), "NetworkPolicy": ("networking.k8s.io", "networkpolicies"), "Job": ("batch", "jobs"),
    "Role": ("rbac.authorization.k8s.io", "roles"), "RoleBinding": ("rbac.authorization.k8s.io", "rolebindings"),
}
GROUPS = {resource: group for group, resource in KINDS.values()} | {"pods/log": "", "events": ""}


# What a kubectl command asks the API server, as (verb, resource, name); name None where the
# Role cannot match one: create (the object has no name yet), a generated name, a list by labels.
# From kubectl's source (pkg/cmd/apply, delete, wait/delete.go, logs, describe; polymorphichelpers).
def apply(resource, name):
    # Client-side: GET, then POST or PATCH. Server-side: PATCH, which authorizes create too when
    # it creates the object.
    return [("get", resource, name), ("create", resource, None), ("patch", resource, name)]


def delete(resource, name):
    # DELETE, then the wait for it to be gone: a GET (NotFound, since nothing here has a finalizer).
    return [("delete", resource, name), ("get", resource, name)]


def create(resource):
    return [("create", resource, None)]


def get(resource, name):
    return [("get", resource, name)]


def list_pods():
    return [("list", "pods", None)]


def logs_of_job(job):
    # The Job (GET), its first pod (list by its selector; a watch until one exists), that pod's log.
    return [("get", "jobs", job), ("list", "pods", None), ("watch", "pods", None), ("get", "pods/log", None)]


def logs_of_pod():
    return [("get", "pods", None), ("get", "pods/log", None)]


def describe_job(job):
    return [("get", "jobs", job), ("list", "events", None)]


JOB = "the Job of the render"  # job-runner.sh's Job: its name, None for run's generateName
MIGRATE_JOB = "pubsub-outbox-migrate"
# Every kubectl call the holders make in the admin namespace: script -> (the call as the script
# writes it, its requests). The check finds each snippet in its script and every kubectl line of
# the script (outside comments; `kubectl kustomize` is local) in its list.
CALLS = {
    # run_job, sourced by operator/run and bootstrap/run, on the Job of their render.
    "k8s/job-runner.sh": [
        ('kubectl create -f "$rendered" -o name', create("jobs")),
        ('get pods -l "job-name=${job#*/}"', list_pods()),  # pod_status
        ('describe "$job"', describe_job(JOB)),  # a Job whose command has not run after 3 minutes
        ('logs "$job" -c cloud-sql-proxy', logs_of_job(JOB)),
        ('delete it with: kubectl -n $namespace delete $job', delete("jobs", JOB)),  # the hint it prints
        ('logs "$job" -c "$container"', logs_of_job(JOB)),
    ],
    # The Secret and the SQL's ConfigMap of one run (cleanup, then before the Job).
    "k8s/bootstrap/run": [
        ("delete secret pubsub-outbox-bootstrap --ignore-not-found", delete("secrets", "pubsub-outbox-bootstrap")),
        ("delete configmap pubsub-outbox-bootstrap-sql --ignore-not-found",
         delete("configmaps", "pubsub-outbox-bootstrap-sql")),
        ("create configmap pubsub-outbox-bootstrap-sql", create("configmaps")),
        ("create secret generic pubsub-outbox-bootstrap", create("secrets")),
    ],
    "k8s/migrate/wait": [
        ('get "job/$job"', get("jobs", MIGRATE_JOB)),  # the Job exists; its conditions; why it failed
        ('get pods -l "job-name=$job"', list_pods()),  # last_pod
        ('logs "$pod" -c migrate', logs_of_pod()),
        ('logs "$pod" -c cloud-sql-proxy', logs_of_pod()),
    ],
    "k8s/operator/run": [],  # only kubectl kustomize; its Job goes through job-runner.sh
}
# A release's migration (deploy/README.md section 4, "Every release", step 2; the same three lines
# head k8s/migrate/kustomization.yaml): the last Job deleted, then every object of migrate's render
# applied, then migrate/wait.
RELEASE = ("k8s/migrate/kustomization.yaml", [
    ("kubectl -n pubsub-outbox-admin delete job pubsub-outbox-migrate", delete("jobs", MIGRATE_JOB)),
    ("kubectl apply -k deploy/k8s/migrate", "each object of the render: apply(resource, name)"),
    ("deploy/k8s/migrate/wait", "CALLS['k8s/migrate/wait']"),
])


def docs(path):
    return [d for d in yaml.safe_load_all(Path(path).read_text()) if d]


def script_problems(deploy, calls):
    problems = []
    for script, entries in calls.items():
        lines = (deploy / script).read_text().splitlines()
        found = set()
        for n, line in enumerate(lines, 1):
            if line.lstrip().startswith("#") or not re.search(r"\bkubectl\s", line) or "kubectl kustomize" in line:
                continue
            hits = [snippet for snippet, _ in entries if snippet in line]
            found.update(hits)
            if not hits:
                problems.append(f"{script}:{n}: a kubectl call rbac_check.py's CALLS does not list "
                                f"(add it, with the requests it makes): {line.strip()}")
        problems += [f"{script}: CALLS lists {snippet!r}, which the script no longer has"
                     for snippet, _ in entries if snippet not in found]
    text = (deploy / RELEASE[0]).read_text()
    problems += [f"{RELEASE[0]}: the release's {snippet!r} is gone from its header: re-derive RELEASE"
                 for snippet, _ in RELEASE[1] if snippet not in text]
    waits = re.search(r"^job=(\S+)$", (deploy / "k8s/migrate/wait").read_text(), re.M)
    if not waits or waits.group(1) != MIGRATE_JOB:
        problems.append(f"k8s/migrate/wait waits for job {waits and waits.group(1)}, not {MIGRATE_JOB}")
    return problems


def requests(release, runs, calls):
    """(verb, group, resource, name, why) of everything the holders do."""
    out, problems = [], []

    def add(reqs, why, job=None):
        for verb, resource, name in reqs:
            out.append((verb, GROUPS[resource], resource, job if name == JOB else name, why))

    def kind_of(d, where):
        ns = d["metadata"].get("namespace")
        if ns != NAMESPACE:
            problems.append(f"{where}: {d['kind']} {d['metadata'].get('name')} is in namespace {ns}, "
                            f"where the Role (in {NAMESPACE}) grants nothing")
        if d["kind"] not in KINDS:
            problems.append(f"{where}: kind {d['kind']} is not in rbac_check.py's KINDS")
            return None
        return KINDS[d["kind"]][1]

    jobs = [d["metadata"]["name"] for d in release if d["kind"] == "Job"]
    if MIGRATE_JOB not in jobs:
        problems.append(f"the release's render has no Job {MIGRATE_JOB} (migrate/wait waits for it)")
    for d in release:
        resource = kind_of(d, "migrate's apply")
        if resource:
            add(apply(resource, d["metadata"]["name"]), f"kubectl apply -k migrate: {d['kind']} {d['metadata']['name']}")
    add(RELEASE[1][0][1], "the release: " + RELEASE[1][0][0])
    for script in ("k8s/migrate/wait", "k8s/bootstrap/run"):
        for snippet, reqs in calls[script]:
            add(reqs, f"{script}: {snippet}")
    for script, path in runs:
        for d in docs(path):
            resource = kind_of(d, f"{script} ({Path(path).name})")
            if resource != "jobs":
                if resource:
                    add(create(resource), f"{script}: kubectl create -f: {d['kind']}")
                continue
            job = d["metadata"].get("name")  # None with generateName: a name no Role can list
            for snippet, reqs in calls["k8s/job-runner.sh"]:
                add(reqs, f"{script} (job-runner.sh): {snippet}", job)
    return out, problems


def rule_allows(rule, verb, group, resource, name):
    names = rule.get("resourceNames")
    return (verb in rule["verbs"] or "*" in rule["verbs"]) and group in rule["apiGroups"] \
        and resource in rule["resources"] and (not names or name in names)


def role_problems(role, reqs):
    rules = role["rules"]
    problems = sorted({f"the Role lacks {verb} on {resource}" + (f" {name}" if name else " (any name)")
                       + f", needed by {why}"
                       for verb, group, resource, name, why in reqs
                       if not any(rule_allows(r, verb, group, resource, name) for r in rules)})
    for i, rule in enumerate(rules):
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    for name in rule.get("resourceNames") or [None]:
                        what = f"rule {i}: {verb} on {resource}" + (f" {name}" if name else "")
                        used = [r for r in reqs if r[:3] == (verb, group, resource) and (name is None or r[3] == name)]
                        if not used:
                            problems.append(f"{what}: nothing the holders run needs it")
                        elif name and any(j != i and rule_allows(o, verb, group, resource, None)
                                          for j, o in enumerate(rules)):
                            problems.append(f"{what}: another rule already grants {verb} on every {resource}")
    return problems


def check(deploy, common, release, runs, calls=CALLS):
    roles = [d for d in docs(common) if d["kind"] == "Role" and d["metadata"]["name"] == ROLE]
    if len(roles) != 1 or roles[0]["metadata"].get("namespace") != NAMESPACE:
        return [f"{common}: no Role {ROLE} in {NAMESPACE}"], ""
    problems = script_problems(deploy, calls)
    reqs, more = requests(release, runs, calls)
    problems += more + role_problems(roles[0], reqs)
    grants = sum(len(r["verbs"]) for r in roles[0]["rules"])
    return problems, (f"the Role's {len(roles[0]['rules'])} rules ({grants} verbs) allow each of the "
                      f"{len({r[:4] for r in reqs})} requests of migrate's apply ({len(release)} objects), "
                      f"its wait, operator/run and bootstrap/run, and nothing else")


def self_test(deploy, common, release, runs):
    def with_role(edit):
        def build(tmp):
            out = tmp / "common.yaml"
            changed = docs(common)
            edit(next(d for d in changed if d["kind"] == "Role"))
            out.write_text(yaml.safe_dump_all(changed))
            return check(deploy, out, release, runs)[0]
        return build

    def drop(i, verb):
        return lambda role: role["rules"][i]["verbs"].remove(verb)

    def exec_into_pods(role):
        role["rules"].append({"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create"]})

    def unlisted_call(tmp):
        copy = tmp / "deploy"
        shutil.copytree(deploy / "k8s", copy / "k8s")
        runner = copy / "k8s/job-runner.sh"
        runner.write_text(runner.read_text() + '\tkubectl -n "$namespace" exec "$job" -- true\n')
        return check(copy, common, release, runs)[0]

    def secret_in_migrate(tmp):
        planted = release + [{"apiVersion": "v1", "kind": "Secret",
                              "metadata": {"name": "pubsub-outbox-migrate", "namespace": NAMESPACE}}]
        return check(deploy, common, planted, runs)[0]

    role = next(d for d in docs(common) if d["kind"] == "Role")
    cases = [(f"the Role without {verb} in rule {i} ({', '.join(rule['resources'])})", with_role(drop(i, verb)),
              "the Role lacks")
             for i, rule in enumerate(role["rules"]) for verb in rule["verbs"]]
    cases += [
        ("the Role with create on pods/exec", with_role(exec_into_pods), "nothing the holders run needs it"),
        ("job-runner.sh with a kubectl exec CALLS does not list", unlisted_call, "CALLS does not list"),
        ("a Secret in migrate's render", secret_in_migrate, "the Role lacks get on secrets pubsub-outbox-migrate"),
    ]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for what, build, expected in cases:
            case = Path(tempfile.mkdtemp(dir=tmp))
            failures += selfcheck.not_refused(what, build(case), expected)
    selfcheck.finish(failures, f"refuses {len(cases)} broken copies: the Role without each of its verbs, with "
                               "pods/exec; a kubectl call not in CALLS; an object migrate's apply cannot write")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--self-test", action="store_true")
    parser.add_argument("common", help="the render of k8s/common (or its overlay): the Role")
    parser.add_argument("--release", required=True, help="the render of k8s/migrate (or its overlay)")
    parser.add_argument("--operator-run", nargs="+", default=[], help="operator/run --print renders")
    parser.add_argument("--bootstrap-run", nargs="+", default=[], help="bootstrap/run --print renders")
    args = parser.parse_args()
    deploy = Path(__file__).resolve().parent
    release = docs(args.release)
    runs = [("operator/run", p) for p in args.operator_run] + [("bootstrap/run", p) for p in args.bootstrap_run]
    if args.self_test:
        self_test(deploy, args.common, release, runs)
        return
    problems, summary = check(deploy, args.common, release, runs)
    selfcheck.finish(problems, summary)


if __name__ == "__main__":
    sys.exit(main())
