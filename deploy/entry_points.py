"""Each kustomize entry point applies only its own objects (deploy/check).

`kubectl apply -k` writes every object a kustomization renders. When one entry point renders
another's objects (the console including ../common, say), applying it writes that other part's
objects back as this folder has them: placeholders over a live dispatcher's identity and
configuration. So each object belongs to exactly one entry point:

  common            the namespaces, their default-deny policies, the proxy's instance name, the
                    admin Jobs' Role
  the root          the dispatcher (also rendered with the per-topic component: its alternative)
  migrate           the migration Job and its identity
  operator          the operator's identity and policy; operator/job the template of its Jobs
  bootstrap         the bootstrap's identity and policy; bootstrap/job the template of its Job
  console           the console

and no two renders contain the same kind, namespace and name. The console's IAP audience belongs
to none: its ConfigMap is made once by hand, so no apply reverts it; the console's Deployment
must read it from there (a required configMapKeyRef). No entry point renders a Secret: the only
one, the bootstrap's password, is made by bootstrap/run for one run and read by its Job as a file
(a required secret volume; never an environment variable). The admin Jobs (migrate, operator, bootstrap) run in the admin namespace,
never in the dispatcher's.

Usage: entry_points.py K8S_DIR               the check
       entry_points.py --self-test K8S_DIR   the check run on broken copies, each of which it must refuse
"""

import shutil
import subprocess
import tempfile
from pathlib import Path

import yaml

import selfcheck

# Entry point -> the folders rendered for it (relative to k8s/); "+per-topic" turns the component on.
ENTRY_POINTS = {
    "common": ["common"],
    "dispatcher": [".", ".+per-topic"],
    "migrate": ["migrate"],
    "operator": ["operator"],
    "operator job": ["operator/job"],
    "bootstrap": ["bootstrap"],
    "bootstrap job": ["bootstrap/job"],
    "console": ["console"],
}
ADMIN_NAMESPACE = "pubsub-outbox-admin"
ADMIN_ENTRY_POINTS = ("migrate", "operator", "operator job", "bootstrap", "bootstrap job")
BOOTSTRAP_SECRET = "pubsub-outbox-bootstrap"
IAP_CONFIGMAP = "pubsub-outbox-console-iap"
IAP_KEY = "OUTBOX_CONSOLE_IAP_AUDIENCE"


def render(k8s: Path, folder: str) -> list[dict]:
    path = k8s / folder.removesuffix("+per-topic")
    with tempfile.TemporaryDirectory() as tmp:
        if folder.endswith("+per-topic"):
            copy = Path(tmp) / "k8s"
            shutil.copytree(k8s, copy)
            kustomization = copy / "kustomization.yaml"
            text = kustomization.read_text()
            enabled = text.replace("# components:\n#   - per-topic", "components:\n  - per-topic")
            if enabled == text:
                raise SystemExit("k8s/kustomization.yaml: the commented `components: [per-topic]` is gone")
            kustomization.write_text(enabled)
            path = copy
        out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"kubectl kustomize {folder}: {out.stderr.strip()}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def key(doc: dict) -> str:
    meta = doc["metadata"]
    return f"{doc['kind']} {meta.get('namespace', '-')}/{meta['name']}"


def iap_problems(console: list[dict]) -> list[str]:
    problems = []
    for d in console:
        if d["kind"] == "ConfigMap" and (d["metadata"]["name"] == IAP_CONFIGMAP or IAP_KEY in d.get("data", {})):
            problems.append(f"console: {key(d)} holds {IAP_KEY}: every apply would put the placeholder back")
    refs = [e["valueFrom"]["configMapKeyRef"]
            for d in console if d["kind"] == "Deployment"
            for c in d["spec"]["template"]["spec"]["containers"]
            for e in c.get("env", []) if e["name"] == IAP_KEY and "configMapKeyRef" in e.get("valueFrom", {})]
    if not any(r["name"] == IAP_CONFIGMAP and r["key"] == IAP_KEY and not r.get("optional", False) for r in refs):
        problems.append(f"console: the Deployment must read {IAP_KEY} from ConfigMap {IAP_CONFIGMAP} "
                        "(configMapKeyRef, not optional)")
    return problems


def secret_problems(renders: dict[str, list[dict]]) -> list[str]:
    problems = [f"{folder}: renders {key(d)}: a Secret in a kustomization is written by every apply"
                for folder, docs in renders.items() for d in docs if d["kind"] == "Secret"]
    jobs = [d for d in renders["bootstrap/job"] if d["kind"] == "Job"]
    volumes = [v["secret"] for d in jobs for v in d["spec"]["template"]["spec"].get("volumes", [])
               if "secret" in v]
    if not any(v["secretName"] == BOOTSTRAP_SECRET and not v.get("optional", False) for v in volumes):
        problems.append(f"bootstrap/job: the Job must read the password from Secret {BOOTSTRAP_SECRET} "
                        "as a file (a secret volume, not optional)")
    containers = [c for d in jobs for c in d["spec"]["template"]["spec"]["containers"]]
    in_env = [f"{c['name']}: {e['name']}" for c in containers for e in c.get("env", [])
              if "secretKeyRef" in e.get("valueFrom", {}) or e["name"] == "PGPASSWORD"]
    in_env += [f"{c['name']}: envFrom {e['secretRef']['name']}" for c in containers
               for e in c.get("envFrom", []) if "secretRef" in e]
    if in_env:
        problems.append(f"bootstrap/job: a secret in an environment variable ({', '.join(in_env)}): "
                        "an env dump shows it; mount the Secret as a file")
    return problems


def namespace_problems(renders: dict[str, list[dict]]) -> list[str]:
    return [f"{folder}: {key(d)} is outside {ADMIN_NAMESPACE}: who may create pods in the dispatcher's "
            "namespace could run it"
            for entry in ADMIN_ENTRY_POINTS for folder in ENTRY_POINTS[entry] for d in renders[folder]
            if d["metadata"].get("namespace") != ADMIN_NAMESPACE]


def check(k8s: Path) -> tuple[list[str], str]:
    owners: dict[str, set[str]] = {}
    renders = {}
    for entry, folders in ENTRY_POINTS.items():
        for folder in folders:
            docs = render(k8s, folder)
            renders[folder] = docs
            for d in docs:
                owners.setdefault(key(d), set()).add(entry)
    problems = [f"{obj} is rendered by more than one entry point: {', '.join(sorted(entries))} "
                "(applying one writes the other's copy back)"
                for obj, entries in sorted(owners.items()) if len(entries) > 1]
    problems += [f"{folder}: renders nothing" for folder, docs in renders.items() if not docs]
    problems += iap_problems(renders["console"])
    problems += secret_problems(renders)
    problems += namespace_problems(renders)
    return problems, (f"{len(ENTRY_POINTS)} entry points, {len(owners)} objects, each applied by one "
                      f"entry point; the console's IAP audience and the bootstrap's password by none; "
                      f"the admin Jobs in {ADMIN_NAMESPACE}")


def self_test(k8s: Path) -> None:
    def include(folder, resource):
        def edit(copy):
            path = copy / folder / "kustomization.yaml"
            path.write_text(path.read_text().replace("resources:\n", f"resources:\n  - {resource}\n", 1))
        return edit

    def copy_in(file, folder):
        def edit(copy):
            shutil.copy(copy / file, copy / folder / "copied.yaml")  # file: relative to k8s/
            include(folder, "copied.yaml")(copy)
        return edit

    def iap_in_kustomization(copy):
        (copy / "console/iap.yaml").write_text(
            f"apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {IAP_CONFIGMAP}\n"
            f"data:\n  {IAP_KEY}: /projects/PROJECT_NUMBER/global/backendServices/SERVICE_ID\n")
        include("console", "iap.yaml")(copy)

    def secret_in_bootstrap(copy):
        (copy / "bootstrap/secret.yaml").write_text(
            f"apiVersion: v1\nkind: Secret\nmetadata:\n  name: {BOOTSTRAP_SECRET}\n"
            "stringData:\n  PGPASSWORD: hunter2\n")
        include("bootstrap", "secret.yaml")(copy)

    def migrate_in_dispatcher_namespace(copy):
        path = copy / "migrate/kustomization.yaml"
        path.write_text(path.read_text().replace(f"namespace: {ADMIN_NAMESPACE}", "namespace: pubsub-outbox"))

    def password_in_env(copy):
        path = copy / "bootstrap/job/job.yaml"
        path.write_text(path.read_text().replace(
            "            - name: PGPASSFILE\n              value: /tmp/pgpass\n",
            "            - name: PGPASSWORD\n              valueFrom:\n                secretKeyRef:\n"
            f"                  name: {BOOTSTRAP_SECRET}\n                  key: PGPASSWORD\n"))

    cases = [
        # Both namespaces in ../common: the console's or migrate's namespace transformer folds them
        # into one, and kustomize refuses the render itself (which the check reports).
        ("the console including ../common (as on 2847324)", include("console", "../common"), "ID conflict"),
        ("migrate including ../common (as on 2847324)", include("migrate", "../common"), "ID conflict"),
        ("the operator with a copy of the migration's identity", copy_in("migrate/serviceaccount.yaml", "operator"),
         "ServiceAccount pubsub-outbox-admin/pubsub-outbox-migrate"),
        ("the IAP audience's ConfigMap in the console's kustomization", iap_in_kustomization, IAP_KEY),
        ("the bootstrap's password as a Secret in its kustomization", secret_in_bootstrap, "renders Secret"),
        ("the bootstrap's password in an environment variable", password_in_env, "a secret in an environment variable"),
        ("the migration Job back in the dispatcher's namespace (as on 20ab8c0)", migrate_in_dispatcher_namespace,
         "Job pubsub-outbox/pubsub-outbox-migrate is outside pubsub-outbox-admin"),
    ]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for what, edit, expected in cases:
            copy = Path(tmp) / "k8s"
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(k8s, copy)
            edit(copy)
            try:
                problems, _ = check(copy)
            except SystemExit as refused:  # a render kustomize itself refuses
                problems = [str(refused)]
            failures += selfcheck.not_refused(what, problems, expected)
    selfcheck.finish(failures, f"refuses {len(cases)} broken copies (an entry point that includes ../common among them)")


if __name__ == "__main__":
    selfcheck.main(check, self_test)
