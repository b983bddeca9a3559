#!/usr/bin/env python3
"""deploy/check's release rehearsal: runs deploy/README.md's release steps, as written, on a copy.

The steps are the ```sh blocks between the README's `<!-- release-steps` and
`<!-- /release-steps -->` markers, run in order by bash (-euo pipefail) in a copy of deploy/, with
the example overlay as OVERLAY, the production environment as ENVIRONMENT, and new digests as
DISPATCHER_IMAGE and PRODUCER_IMAGE. What would reach a cluster or a cloud is a stand-in that
records each call with the install's state at that moment:
  kubectl     `apply -k DIR` renders DIR with the real `kubectl kustomize` (what would be applied);
              `kustomize` is the real one; anything else (delete, rollout status) is recorded;
  kustomize   `edit set image NAME=REF`, as kustomize does it: the entry named NAME in ./
              kustomization.yaml's images (added if missing) gets REF's name and digest;
  terraform, git, and deploy/k8s/migrate/wait: recorded.
It fails unless, after the steps, every image of the release is the new digest (the dispatcher,
the migration Job, the console, the operator Job's dispatcher and producer, Terraform's
producer_image), and unless the order held: the migration Job applied from the overlay with the
new image, its wait returned before the dispatcher rolled, and the producer's image (the
overlay's and Terraform's) still the old one until then.

    release_check.py REPO              the README's steps
    release_check.py --self-test REPO  plants broken procedures; each must be refused
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

REPO = "europe-west1-docker.pkg.dev/my-project/pubsub-outbox"
NEW = {"dispatcher": f"{REPO}/dispatcher@sha256:{'d0' * 32}", "producer": f"{REPO}/producer@sha256:{'b0' * 32}"}
OVERLAY = "deploy/overlays/example"
ENVIRONMENT = "deploy/terraform/environments/production"
MARK = re.compile(r"<!-- release-steps.*?-->(.*?)<!-- /release-steps -->", re.S)
FENCE = re.compile(r"^( *)```sh\n(.*?)^\1```", re.S | re.M)

# The stand-in behind every recorded tool (a symlink per name): one JSON line per call.
STAND_IN = r'''#!/usr/bin/env python3
import json, os, subprocess, sys, yaml
sys.path.insert(0, os.environ["RELEASE_CHECK_DIR"])
from release_check import component_producer, tfvars_producer
tool, args = os.path.basename(sys.argv[0]), sys.argv[1:]
env = os.environ
root = env["RELEASE_ROOT"]
event = {"tool": tool, "args": args, "cwd": os.getcwd(), "producer_image": tfvars_producer(root),
         "component_producer": component_producer(root)}
if tool == "kubectl" and args[:1] == ["kustomize"]:
    os.execv(env["REAL_KUBECTL"], [env["REAL_KUBECTL"]] + args)
if tool == "kubectl" and "apply" in args and "-k" in args:
    target = os.path.abspath(args[args.index("-k") + 1])
    n = sum(1 for _ in open(env["EVENTS"]))
    out = os.path.join(env["RENDERS"], f"{n}.yaml")
    with open(out, "w") as f:
        if subprocess.run([env["REAL_KUBECTL"], "kustomize", target], stdout=f).returncode != 0:
            sys.exit(f"kubectl (stand-in): {target} does not render")
    event.update(apply=target, render=out)
if tool == "kustomize":
    if args[:3] != ["edit", "set", "image"] or len(args) != 4 or "=" not in args[3]:
        sys.exit(f"kustomize (stand-in): only `edit set image NAME=REF`, not {args}")
    name, ref = args[3].split("=", 1)
    path = "kustomization.yaml"
    doc = yaml.safe_load(open(path))
    images = doc.setdefault("images", [])
    entry = next((i for i in images if i.get("name") == name), None)
    if entry is None:
        entry = {"name": name}
        images.append(entry)
    new_name, _, digest = ref.partition("@")
    entry["newName"] = new_name
    if digest:
        entry["digest"] = digest
    yaml.safe_dump(doc, open(path, "w"), sort_keys=False)
with open(env["EVENTS"], "a") as f:
    f.write(json.dumps(event) + "\n")
'''


def steps(readme):
    """The release steps: the sh blocks between the markers, dedented, in order."""
    marked = MARK.search(readme)
    if not marked:
        raise SystemExit("deploy/README.md has no <!-- release-steps --> … <!-- /release-steps --> section")
    blocks = []
    for indent, body in FENCE.findall(marked.group(1)):
        blocks.append("\n".join(line[len(indent):] for line in body.splitlines()))
    if not blocks:
        raise SystemExit("the release-steps section holds no ```sh block")
    return "\n".join(blocks) + "\n"


def ours(text):
    """The images of ours (dispatcher, producer) in rendered YAML: [(kind/name, image)]."""
    found = []
    for doc in yaml.safe_load_all(text):
        spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            if re.search(r"/(dispatcher|producer)[@:]", c["image"]):
                meta = doc["metadata"]
                found.append((f"{doc['kind']}/{meta.get('name') or meta.get('generateName')}", c["image"]))
    return found


def applied(event):
    """The images of ours in what a recorded `kubectl apply -k` would have applied."""
    return ours(open(event["render"]).read())


def rehearse(repo, script):
    """Runs `script` on a copy of repo's deploy/ and returns the problems found (empty: it holds)."""
    work = tempfile.mkdtemp()
    try:
        return _rehearse(repo, script, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _rehearse(repo, script, work):
    root = os.path.join(work, "repo")
    shutil.copytree(os.path.join(repo, "deploy"), os.path.join(root, "deploy"),
                    ignore=shutil.ignore_patterns(".terraform", "__pycache__"))
    bin_dir, renders = os.path.join(work, "bin"), os.path.join(work, "renders")
    os.makedirs(bin_dir)
    os.makedirs(renders)
    events = os.path.join(work, "events.jsonl")
    open(events, "w").close()
    stand_in = os.path.join(bin_dir, "stand-in")
    with open(stand_in, "w") as f:
        f.write(f"#!{sys.executable}\n" + STAND_IN.split("\n", 1)[1])
    os.chmod(stand_in, 0o755)
    for tool in ("kubectl", "kustomize", "terraform", "git"):
        os.symlink(stand_in, os.path.join(bin_dir, tool))
    # migrate/wait polls the cluster: its stand-in records that the steps waited.
    os.symlink(stand_in, os.path.join(bin_dir, "wait"))
    with open(os.path.join(root, "deploy/k8s/migrate/wait"), "w") as f:
        f.write(f"#!/bin/sh\nexec {os.path.join(bin_dir, 'wait')} \"$@\"\n")
    real_kubectl = shutil.which("kubectl")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", REAL_KUBECTL=real_kubectl,
               EVENTS=events, RENDERS=renders, OVERLAY=OVERLAY, ENVIRONMENT=ENVIRONMENT, REPO=REPO,
               DISPATCHER_IMAGE=NEW["dispatcher"], PRODUCER_IMAGE=NEW["producer"],
               OUTBOX_ACTOR="release-check", RELEASE_ROOT=root,
               RELEASE_CHECK_DIR=os.path.dirname(os.path.abspath(__file__)), PYTHONDONTWRITEBYTECODE="1")
    old_producer = tfvars_producer(root)
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=root, env=env,
                         capture_output=True, text=True)
    if run.returncode != 0:
        return [f"the release steps failed (exit {run.returncode}):\n{run.stdout}{run.stderr}"]
    log = [json.loads(line) for line in open(events)]
    return order(log, root, old_producer) + after(root, env)


def tfvars_producer(root):
    """Terraform's producer_image in the environment's release file under root."""
    text = open(os.path.join(root, ENVIRONMENT, "release.auto.tfvars")).read()
    m = re.search(r'^producer_image\s*=\s*"([^"]*)"', text, re.M)
    return m.group(1) if m else None


def component_producer(root):
    """The producer's image in the overlays' release component under root."""
    path = os.path.join(root, OVERLAY, "release", "kustomization.yaml")
    doc = yaml.safe_load(open(path)) if os.path.exists(path) else None
    for image in (doc or {}).get("images", []):
        if image.get("name", "").endswith("/producer"):
            return f"{image.get('newName')}@{image.get('digest')}"
    return None


def order(log, root, old_producer):
    """The order of the calls: migrate (from the overlay, new image) → wait → roll; producer last."""
    problems = []
    overlay = os.path.join(root, OVERLAY)
    applies = [(i, e) for i, e in enumerate(log) if "apply" in e]
    migrate = [(i, e) for i, e in applies if any(o.startswith("Job/pubsub-outbox-migrate") for o, _ in applied(e))]
    waits = [i for i, e in enumerate(log) if e["tool"] == "wait"]
    rolls = [(i, e) for i, e in applies if any(o == "Deployment/pubsub-outbox-dispatcher" for o, _ in applied(e))]
    if not migrate:
        return ["the steps never apply the migration Job"]
    i, e = migrate[0]
    if not e["apply"].startswith(overlay + os.sep):
        problems.append(f"the migration Job is applied from {os.path.relpath(e['apply'], root)}, not from the overlay")
    stale = [f"{o} {img}" for o, img in applied(e) if img != NEW["dispatcher"]]
    if stale:
        problems.append(f"the migration Job is applied with {', '.join(stale)}, not the new dispatcher image")
    waited = [w for w in waits if w > i]
    if not waited:
        problems.append("nothing waits for the migration Job (deploy/k8s/migrate/wait) after it is applied")
    if not rolls or (waited and rolls[0][0] < waited[0]):
        problems.append("the dispatcher is not rolled out after the migration has completed")
    until = waited[0] if waited else len(log)
    early = [e for e in log[:until] if e["producer_image"] != old_producer]
    if early:
        problems.append(f"Terraform's producer_image moved before the migration completed "
                        f"(at `{early[0]['tool']} {' '.join(early[0]['args'])}`): the producer would meet the old schema")
    early_job = [e for e in log[:until] if e["component_producer"] == NEW["producer"]]
    if early_job:
        problems.append(f"the overlays' producer image (the operator Job's) moved before the migration "
                        f"completed (at `{early_job[0]['tool']} {' '.join(early_job[0]['args'])}`)")
    applies_tf = [e for e in log if e["tool"] == "terraform" and "apply" in e["args"]]
    if not any(e["producer_image"] == NEW["producer"] for e in applies_tf):
        problems.append("no `terraform apply` runs with the new producer_image")
    return problems


def after(root, env):
    """Every image of the release is the new digest once the steps are done."""
    problems = []
    kubectl = env["REAL_KUBECTL"]
    renders = {}
    for entry in ("dispatcher", "migrate", "console"):
        out = subprocess.run([kubectl, "kustomize", os.path.join(root, OVERLAY, entry)], capture_output=True, text=True)
        renders[entry] = out.stdout
    for binary, command in (("dispatcher", "status"), ("producer", "streams")):
        out = subprocess.run([os.path.join(root, "deploy/k8s/operator/run"), "--overlay",
                              os.path.join(root, OVERLAY, "operator-job"), "--print", binary, command],
                             capture_output=True, text=True, env=dict(env, PATH=os.environ["PATH"]))
        renders[f"operator Job ({binary} {command})"] = out.stdout + out.stderr
    for what, text in renders.items():
        try:
            found = ours(text)
        except yaml.YAMLError:
            problems.append(f"{what} does not render: {text[:300]}")
            continue
        if not found:
            problems.append(f"{what}: no image of ours rendered")
        for obj, image in found:
            want = NEW["producer"] if "/producer" in image else NEW["dispatcher"]
            if image != want:
                problems.append(f"{what}: {obj} runs {image}, not the release's {want}")
    if tfvars_producer(root) != NEW["producer"]:
        problems.append(f"{ENVIRONMENT}/release.auto.tfvars: producer_image is {tfvars_producer(root)}, not {NEW['producer']}")
    return problems


# The procedures the self-test plants, each of which must be refused.
EARLIER = """\
# deploy/README.md before issue #52: `kustomize edit set image pubsub-outbox-dispatcher=…` in the
# folders applied (here: the overlays), the producer's digest with them, then migrate and roll.
for d in dispatcher migrate console operator-job; do
  (cd "$OVERLAY/$d" && kustomize edit set image "pubsub-outbox-dispatcher=$DISPATCHER_IMAGE")
done
(cd "$OVERLAY/operator-job" && kustomize edit set image "pubsub-outbox-producer=$PRODUCER_IMAGE")
sed -i "s|^producer_image = .*|producer_image = \\"$PRODUCER_IMAGE\\"|" "$ENVIRONMENT/release.auto.tfvars"
git commit -am release
kubectl -n pubsub-outbox-admin delete job pubsub-outbox-migrate --ignore-not-found
kubectl apply -k "$OVERLAY/migrate"
deploy/k8s/migrate/wait
kubectl apply -k "$OVERLAY/dispatcher"
kubectl apply -k "$OVERLAY/console"
terraform -chdir="$ENVIRONMENT" apply
"""


def self_test(repo, script):
    plants = {
        "the earlier README's kustomize edit set image pubsub-outbox-dispatcher=…": EARLIER,
        "the producer's image moved before the migration": re.sub(
            r"(?s)\A(.*?)(deploy/release producer[^\n]*\n)", r"\2\1", script),
        "the migration applied from the tracked base": script.replace('"$OVERLAY/migrate"', "deploy/k8s/migrate"),
        # The operator Job's producer (the overlays' release component) moved by hand with the
        # dispatcher's image, Terraform's left alone.
        "the overlays' producer image moved before the migration": script.replace(
            "kubectl -n pubsub-outbox-admin delete job",
            f"sed -i 's/sha256:{'0' * 64}/sha256:{'b0' * 32}/' \"$OVERLAY/release/kustomization.yaml\"\n"
            "kubectl -n pubsub-outbox-admin delete job", 1),
    }
    failed = False
    for name, planted in plants.items():
        if planted == script:
            print(f"could not plant: {name}")
            failed = True
            continue
        problems = rehearse(repo, planted)
        print(f"{'refused' if problems else 'NOT REFUSED'}: {name}" + (f" ({problems[0].splitlines()[0]})" if problems else ""))
        failed |= not problems
    return 1 if failed else 0


def main(argv):
    test = "--self-test" in argv
    argv = [a for a in argv if a != "--self-test"]
    repo = os.path.abspath(argv[0] if argv else os.path.join(os.path.dirname(__file__), ".."))
    script = steps(open(os.path.join(repo, "deploy/README.md")).read())
    if test:
        return self_test(repo, script)
    problems = rehearse(repo, script)
    if problems:
        print("\n".join(problems))
        return 1
    print("the README's release steps, run on overlays/example and environments/production: every image "
          "(dispatcher, migration, console, operator Job, Terraform's producer) is the new digest; "
          "migrate → wait → roll → producer")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
