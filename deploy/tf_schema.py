#!/usr/bin/env python3
"""Check the Terraform configuration against the hashicorp/google provider's published schema.

    python3 deploy/tf_schema.py [--cache DIR] [--provider-major N] [--self-test] TF_DIR [TF_DIR ...]

`terraform validate` needs the provider binary, which these machines cannot download; its schema is
also on PyPI, as the type manifest (.jsii) of the provider's CDK bindings (MANIFESTS, picked by the
floor of the hashicorp/google constraint in required_providers). Read once into a JSON summary in
the cache, it checks every google_* resource and data block: the type exists, every argument and
block exists at its level (in dynamic blocks too), the required ones are there, a block of at most
one item is not repeated. Uses python-hcl2's Lark tree (its 8.x API, or checkov's 0.4.x over it).
"""
import argparse, difflib, gzip, hashlib, io, json, re, shutil, subprocess, sys, tarfile, tempfile, zipfile
from pathlib import Path

# Provider major -> the manifest of its schema. Add a major (or a newer release) here: the wheel's
# sha256 is PyPI's (pip download checks it against the index; this guards the cached copy too).
MANIFESTS = {
    6: {"provider": "6.50.0", "package": "cdktf-cdktf-provider-google", "version": "16.12.1",
        "sha256": "88d021c89e1cf2abf2c935716d6548d26fe3da4bed30713d4fa36df1ef137436"},
    8: {"provider": "8.7.0", "package": "cdktn-provider-google", "version": "21.1.0",
        "sha256": "157dead5025d5db5abe48e40cc49f0b6a4d8088fd0498eb17ad5a36bca811b2a"},
}
SUMMARY_FORMAT = 1
META_ARGS = {"count", "for_each", "depends_on", "provider"}  # top level of a resource/data block
META_BLOCKS = {"lifecycle", "provisioner", "connection"}
GOOGLE_SOURCES = {"hashicorp/google", "registry.terraform.io/hashicorp/google"}


# ---- the schema, from the manifest ------------------------------------------------------------

def fetch_wheel(spec, cache):
    """Return the manifest's wheel in cache/wheels, downloading it with pip the first time."""
    wheels = cache / "wheels"
    pattern = f"{spec['package'].replace('-', '_')}-{spec['version']}-*.whl"
    found = sorted(wheels.glob(pattern))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        print(f"downloading {spec['package']}=={spec['version']} (the provider's schema, once)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-cache-dir",
                        "--no-deps", "--only-binary=:all:", f"{spec['package']}=={spec['version']}", "-d", str(wheels)],
                       check=True)
        found = sorted(wheels.glob(pattern))
    if not found:
        sys.exit(f"tf_schema: pip did not leave {pattern} in {wheels}")
    digest = hashlib.sha256(found[0].read_bytes()).hexdigest()
    if digest != spec["sha256"]:
        found[0].unlink()
        sys.exit(f"tf_schema: {found[0].name} has sha256 {digest}, not the pinned {spec['sha256']} (removed it)")
    return found[0]


def read_assembly(wheel):
    """The jsii assembly inside the wheel: _jsii/*.jsii.tgz -> package/.jsii (maybe a redirect to .jsii.gz)."""
    with zipfile.ZipFile(wheel) as whl:
        tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
            doc = json.load(tar.extractfile("package/.jsii"))
            if doc.get("schema") == "jsii/file-redirect":
                raw = tar.extractfile("package/" + doc["filename"]).read()
                doc = json.loads(gzip.decompress(raw) if doc.get("compression") == "gzip" else raw)
    return doc


def snake(name):
    """camelCase -> snake_case (fallback only: the docs' registry anchor is the exact name)."""
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def tf_name(prop):
    """Terraform name of a config property: the anchor of its 'Docs at Terraform Registry' link."""
    docs = " ".join(str(v) for v in prop.get("docs", {}).values())
    found = re.findall(r"Docs at Terraform Registry: \{@link \S+#(\w+) ", docs)
    return found[-1] if found else snake(prop["name"])


def struct_of(jtype, types):
    """(struct fqn, is a list) of a property type: a struct, or a list of them (maybe in a union)."""
    if "fqn" in jtype:
        return (jtype["fqn"], False) if types.get(jtype["fqn"], {}).get("datatype") else (None, False)
    if "collection" in jtype:
        return struct_of(jtype["collection"]["elementtype"], types)[0], True
    for member in jtype.get("union", {}).get("types", []):
        fqn, many = struct_of(member, types)
        if fqn:
            return fqn, many
    return None, False


def computed_only(types, cls_fqn, config_names):
    """Getters of the resource class (or a block's OutputReference) that are no config property."""
    cls = types.get(cls_fqn, {})
    return sorted(snake(p["name"]) for p in cls.get("properties", [])
                  if p.get("immutable") and not p.get("optional") and not p.get("static")
                  and not p["name"].endswith("Input") and p["name"] not in config_names)


def struct_schema(types, fqn, cls_fqn, ancestors=()):
    """Schema of one level: {args: {name: required?}, computed: [...], blocks: {name: {...}}}.

    A struct that contains itself (the bindings fold a few deep schemas into a cycle) is "open":
    its contents are not checked."""
    if fqn in ancestors:
        return {"args": {}, "computed": [], "blocks": {}, "open": True}
    props = types[fqn].get("properties", [])
    level = {"args": {}, "computed": computed_only(types, cls_fqn, {p["name"] for p in props}), "blocks": {}}
    for prop in props:
        name, required = tf_name(prop), not prop.get("optional")
        inner, many = struct_of(prop["type"], types)
        if inner:
            block = struct_schema(types, inner, inner + "OutputReference", ancestors + (fqn,))
            block.update(min_items=1 if required else 0, max_items=None if many else 1)
            level["blocks"][name] = block
        else:
            level["args"][name] = required
    return level


def summarize(assembly, spec):
    """Resource and data source types of the assembly -> the cached summary."""
    types = assembly["types"]
    summary = {"format": SUMMARY_FORMAT, "provider": spec["provider"], "package": spec["package"],
               "version": spec["version"], "resource": {}, "data": {}}
    link = re.compile(r"/docs/(resources|data-sources)/\w+ (google_\w+)\}")
    for fqn, cls in types.items():
        found = link.search(cls.get("docs", {}).get("summary", ""))
        base = cls.get("base", "")
        if cls["kind"] != "class" or not found or not base.endswith(("TerraformResource", "TerraformDataSource")):
            continue
        config = next(p["type"]["fqn"] for p in cls["initializer"]["parameters"] if p["name"] == "config")
        kind = "resource" if found[1] == "resources" else "data"
        summary[kind][found[2]] = struct_schema(types, config, fqn)
    return summary


def load_schema(spec, cache):
    """The summary for spec from the cache, building it (and fetching the wheel) if it is missing."""
    path = cache / f"google-{spec['provider']}-{spec['package']}-{spec['version']}.v{SUMMARY_FORMAT}.json"
    if path.exists():
        return json.loads(path.read_text())
    summary = summarize(read_assembly(fetch_wheel(spec, cache)), spec)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, separators=(",", ":"), sort_keys=True))
    tmp.replace(path)
    return summary


# ---- the configuration -------------------------------------------------------------------------

def parse_tree(text):
    """Lark parse tree of HCL text, from python-hcl2 8.x or from the 0.4.x API."""
    import hcl2.api
    if hasattr(hcl2.api, "parses_to_tree"):
        return hcl2.api.parses_to_tree(text)
    from hcl2.parser import hcl2 as legacy
    return legacy.lark_parser.parse(text + "\n")


def span(node):
    """(start, end, line) of a Lark tree or token."""
    meta = getattr(node, "meta", node)
    return meta.start_pos, meta.end_pos, meta.line


def body_of(tree, text):
    """A body tree -> {"attrs": {name: attr}, "blocks": [block]}, each with its source positions."""
    body = {"attrs": {}, "blocks": []}
    if getattr(tree, "data", None) == "start":  # the file: start -> body
        tree = next(c for c in tree.children if getattr(c, "data", None) == "body")
    for node in getattr(tree, "children", []):
        if getattr(node, "data", None) == "attribute":
            start, end, line = span(node.children[0])
            value = node.children[-1]
            body["attrs"][text[start:end]] = {"line": line, "name_span": (start, end),
                                              "span": span(node)[:2], "value": text[span(value)[0]:span(value)[1]]}
        elif getattr(node, "data", None) == "block":
            parts = node.children
            inner = next(c for c in parts if getattr(c, "data", None) == "body")
            heads = [c for c in parts[:parts.index(inner)]
                     if getattr(c, "data", None) in ("identifier", "keyword", "literal_value", "string")
                     or getattr(c, "type", None) in ("STRING_LIT", "NAME")]
            spans = [span(c) for c in heads]
            body["blocks"].append({"type": text[spans[0][0]:spans[0][1]], "line": spans[0][2],
                                   "labels": [text[s:e].strip('"') for s, e, _ in spans[1:]],
                                   "spans": [(s, e) for s, e, _ in spans], "body": body_of(inner, text)})
    return body


def read_dirs(dirs):
    """Every *.tf of the given directories (not recursive) -> [(path, body)]."""
    files = []
    for path in (p for d in dirs for p in sorted(Path(d).glob("*.tf"))):
        text = path.read_text()
        try:
            files.append((path, body_of(parse_tree(text), text)))
        except Exception as err:  # lark's errors have no common base worth naming
            sys.exit(f"{path}: cannot parse: {err}")
    return files


def provider_constraints(files):
    """Local names bound to hashicorp/google and their version constraints, from required_providers."""
    names, constraints = {"google"}, []
    for path, body in files:
        for tf in (b for b in body["blocks"] if b["type"] == "terraform"):
            for rp in (b for b in tf["body"]["blocks"] if b["type"] == "required_providers"):
                for local, attr in rp["body"]["attrs"].items():
                    source = re.search(r'source\s*=\s*"([^"]+)"', attr["value"])
                    if source and source[1].lower() in GOOGLE_SOURCES:
                        names.add(local)
                        version = re.search(r'version\s*=\s*"([^"]+)"', attr["value"])
                        if version:
                            constraints.append((f"{path}:{attr['line']}", version[1]))
    return names, constraints


def vtuple(text):
    """'6.39' -> (6, 39, 0)."""
    nums = [int(n) for n in re.findall(r"\d+", text)[:3]]
    return tuple(nums + [0] * (3 - len(nums)))


def parts(constraint):
    """'>= 6.39, < 7' -> [('>=', '6.39'), ('<', '7')]."""
    return [re.match(r"\s*(>=|<=|~>|!=|>|<|=)?\s*v?([\d.]+)", p).groups() for p in constraint.split(",")]


def allows(constraint, version):
    """Whether a Terraform version constraint (">= 6.39, < 7", "~> 8.7") admits version."""
    v = vtuple(version)
    for op, ver in parts(constraint):
        want, keep = vtuple(ver), max(len(ver.strip(".").split(".")) - 2, 0)  # ~> bumps the next-to-last
        upper = want[:keep] + (want[keep] + 1,) + (0,) * (2 - keep)
        if not {None: v == want, "=": v == want, "!=": v != want, ">": v > want, ">=": v >= want,
                "<": v < want, "<=": v <= want, "~>": want <= v < upper}[op]:
            return False
    return True


def floor(constraint):
    """The lowest version a constraint admits (its >=, >, =, ~> or bare version), or None."""
    return max((vtuple(v) for op, v in parts(constraint) if op in (None, "=", ">=", ">", "~>")), default=None)


def pick_manifest(constraints, major_override):
    """The manifest for the constraints' major; exits with the reason if there is none that fits."""
    known = ", ".join(f"{m['provider']} ({m['package']} {m['version']})" for m in MANIFESTS.values())
    if not constraints:
        sys.exit("tf_schema: no hashicorp/google version constraint in any required_providers block")
    floors = {where: floor(c) for where, c in constraints}
    if None in floors.values():
        sys.exit(f"tf_schema: a hashicorp/google constraint without a floor: {constraints}")
    majors = {f[0] for f in floors.values()}
    if major_override is None and len(majors) > 1:
        sys.exit(f"tf_schema: the hashicorp/google constraints name different majors: {constraints}")
    major = major_override if major_override is not None else majors.pop()
    spec = MANIFESTS.get(major)
    if spec is None:
        sys.exit(f"tf_schema: no schema manifest for hashicorp/google {major}.x; known: {known}")
    for where, c in constraints:
        if floors[where] > vtuple(spec["provider"]):
            sys.exit(f"tf_schema: {where}: hashicorp/google \"{c}\" starts above the newest known schema "
                     f"{spec['provider']}; add a newer manifest to MANIFESTS (known: {known})")
        if not allows(c, spec["provider"]):
            print(f"note: {where}: \"{c}\" does not admit {spec['provider']}, checked against it anyway",
                  file=sys.stderr)
    return spec


# ---- the check ---------------------------------------------------------------------------------

def names_hint(wrong, known, listing=True):
    """' (did you mean …? known: …)' for an unknown name."""
    close = difflib.get_close_matches(wrong, known, n=3, cutoff=0.6)
    hint = [f"did you mean {' or '.join(close)}?"] if close else []
    if listing:
        hint.append("known: " + ", ".join(sorted(known)[:12]) + (", …" if len(known) > 12 else ""))
    return f" ({' '.join(hint)})" if hint else ""


def check_body(schema, body, at, out, top=False):
    """Append a problem for every unknown, misplaced, missing or repeated name of one level.

    at = (file, line, address) of the level, for the messages."""
    args, blocks = schema["args"], schema["blocks"]
    where = lambda line: f"{at[0]}:{line or at[1]}: {at[2]}: "
    if schema.get("open"):
        return
    for name, attr in body["attrs"].items():
        if top and name in META_ARGS:
            continue
        if name in blocks:
            out.append(f"{where(attr['line'])}\"{name}\" is a block: write {name} {{ … }}, not {name} = …")
        elif name in schema["computed"]:
            out.append(f"{where(attr['line'])}\"{name}\" is computed (read-only): remove it")
        elif name not in args:
            out.append(f"{where(attr['line'])}unknown argument \"{name}\"{names_hint(name, [*args, *blocks])}")
    present, static = set(), {}
    for block in body["blocks"]:
        name, inner, dynamic = block["type"], block["body"], block["type"] == "dynamic"
        if top and name in META_BLOCKS:
            continue
        if dynamic:  # dynamic "name" { for_each = … content { … } }
            name = block["labels"][0] if block["labels"] else "?"
            inner = next((b["body"] for b in inner["blocks"] if b["type"] == "content"), {"attrs": {}, "blocks": []})
        if name in args:
            out.append(f"{where(block['line'])}\"{name}\" is an argument: write {name} = …, not a block")
        elif name not in blocks:
            out.append(f"{where(block['line'])}unknown block \"{name}\"{names_hint(name, [*blocks, *args])}")
        else:
            present.add(name)
            static[name] = static.get(name, 0) + (not dynamic)
            if blocks[name]["max_items"] == 1 and static[name] == 2:
                out.append(f"{where(block['line'])}block \"{name}\" takes at most one item, it is given twice")
            check_body(blocks[name], inner, (at[0], block["line"], f"{at[2]}.{name}"), out)
    for name, required in sorted(args.items()):
        if required and name not in body["attrs"]:
            out.append(f"{where(None)}missing required argument \"{name}\"")
    for name, block in sorted(blocks.items()):
        if block["min_items"] and name not in present:  # a dynamic block counts
            out.append(f"{where(None)}missing required block \"{name}\" (at least {block['min_items']})")


def google_blocks(files, local_names, skipped=None):
    """(kind, type, name, block, path) of every google resource/data block, check{} data included.

    A google_* block on another provider (provider = google-beta) goes to skipped instead."""
    for path, body in files:
        tops = body["blocks"] + [b for c in body["blocks"] if c["type"] == "check" for b in c["body"]["blocks"]]
        for block in tops:
            if block["type"] in ("resource", "data") and len(block["labels"]) == 2:
                rtype, name = block["labels"]
                provider = block["body"]["attrs"].get("provider", {}).get("value", rtype.split("_")[0])
                if rtype.startswith("google_") and provider.split(".")[0] in local_names:
                    yield block["type"], rtype, name, block, path
                elif rtype.startswith("google_") and skipped is not None:
                    skipped.append(f"{rtype}.{name} (provider {provider})")


def prepare(dirs, cache, major_override):
    """(files, google's local names, manifest, schema) for the directories."""
    files = read_dirs(dirs)
    local_names, constraints = provider_constraints(files)
    spec = pick_manifest(constraints, major_override)
    return files, local_names, spec, load_schema(spec, cache)


def run_check(dirs, cache, major_override=None):
    """Check the directories; returns (problems, the success line)."""
    files, local_names, spec, schema = prepare(dirs, cache, major_override)
    problems, counts, skipped = [], {"resource": 0, "data": 0}, []
    for kind, rtype, name, block, path in google_blocks(files, local_names, skipped):
        at = (path, block["line"], f"{'data.' if kind == 'data' else ''}{rtype}.{name}")
        counts[kind] += 1
        if rtype not in schema[kind]:
            hint = names_hint(rtype, list(schema[kind]), listing=False)
            problems.append(f"{at[0]}:{at[1]}: {at[2]}: no {'data source' if kind == 'data' else 'resource type'} "
                            f"{rtype} in hashicorp/google {spec['provider']}{hint}")
            continue
        check_body(schema[kind][rtype], block["body"], at, problems, top=True)
    ok = (f"{counts['resource']} resources and {counts['data']} data sources match hashicorp/google "
          f"{spec['provider']} ({spec['package']} {spec['version']})")
    if skipped:
        ok += f"; not checked, not on hashicorp/google: {', '.join(skipped)}"
    return problems, ok


# ---- the self-test -----------------------------------------------------------------------------

def misspell(name, level):
    """A near miss of name that the level does not know."""
    for wrong in (name[:-1], name + "x", name + "_typo"):
        if wrong not in level["args"] and wrong not in level["blocks"]:
            return wrong


def nested_blocks(body, level, path, depth=1):
    """(depth, block path, block, its parent's level) of every known nested block, dynamic ones too."""
    for block in body["blocks"]:
        dynamic = block["type"] == "dynamic" and block["labels"]
        real = block["labels"][0] if dynamic else block["type"]
        inner = next((b["body"] for b in block["body"]["blocks"] if b["type"] == "content"), None) \
            if dynamic else block["body"]
        if real in level["blocks"]:
            yield depth, f"{path}.{real}", block, level
            if inner:
                yield from nested_blocks(inner, level["blocks"][real], f"{path}.{real}", depth + 1)


def plants(files, schema, local_names):
    """The three edits {what: (description, path, start, end, replacement)} the check must refuse.

    The misspelt block is the deepest one found (through dynamic blocks too), to exercise the recursion."""
    found, deepest = {}, (0,)
    for kind, rtype, name, block, path in google_blocks(files, local_names):
        level, body, addr = schema[kind].get(rtype), block["body"], f"{rtype}.{name}"
        if level is None:
            continue
        for arg, attr in body["attrs"].items():
            if arg in level["args"] and "misspelt argument" not in found:
                wrong = misspell(arg, level)
                found["misspelt argument"] = (f"{addr}: {arg} -> {wrong}", path, *attr["name_span"], wrong)
            if level["args"].get(arg) and "missing required argument" not in found:
                found["missing required argument"] = (f"{addr}: removed {arg}", path, *attr["span"], "")
        for depth, where, nested, parent in nested_blocks(body, level, addr):
            if depth > deepest[0]:
                dynamic = nested["type"] == "dynamic"
                real = where.rsplit(".", 1)[1]
                wrong = misspell(real, parent)
                start, end = nested["spans"][1 if dynamic else 0]
                deepest = (depth, f"{where} -> {wrong}", path, start, end, f'"{wrong}"' if dynamic else wrong)
    if deepest[0]:
        found["misspelt nested block"] = deepest[1:]
    return found


def self_test(dirs, cache, major_override):
    """Plant each mistake in a copy of the configuration; the check must refuse it and pass the original."""
    with tempfile.TemporaryDirectory(prefix="tf-schema-") as tmp:
        copies = [Path(tmp) / f"{i}-{Path(d).resolve().name}" for i, d in enumerate(dirs)]
        for d, copy in zip(dirs, copies):
            copy.mkdir()
            for tf in Path(d).glob("*.tf"):
                shutil.copy(tf, copy / tf.name)
        problems, ok = run_check(copies, cache, major_override)
        print(*["FAIL: the unmodified copy is refused:", *problems] if problems else [f"the unmodified copy: {ok}"],
              sep="\n  ")
        files, local_names, _, schema = prepare(copies, cache, major_override)
        failed, found = bool(problems), plants(files, schema, local_names)
        for what in ("misspelt argument", "missing required argument", "misspelt nested block"):
            if what not in found:
                print(f"FAIL: found no place to plant a {what}")
                failed = True
                continue
            desc, path, start, end, new = found[what]
            original = path.read_text()
            path.write_text(original[:start] + new + original[end:])
            problems, _ = run_check(copies, cache, major_override)
            path.write_text(original)
            planted = desc.split()[-1]  # the misspelt or removed name
            about = [p for p in problems if f'"{planted}"' in p]
            print(f"planted {what} ({desc}): " + (f"refused: {about[0]}" if about else "NOT refused"))
            failed |= not about
    print("self-test passed" if not failed else "self-test FAILED")
    return failed


def main():
    """Command line: check the directories, or self-test on them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", metavar="TF_DIR")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache/pubsub-outbox/tf-schema")
    parser.add_argument("--provider-major", type=int, help="use this major's manifest, whatever the constraint says")
    parser.add_argument("--self-test", action="store_true", help="plant mistakes in a copy; all must be refused")
    opts = parser.parse_args()
    opts.cache.mkdir(parents=True, exist_ok=True)
    if opts.self_test:
        return self_test(opts.dirs, opts.cache, opts.provider_major)
    problems, ok = run_check(opts.dirs, opts.cache, opts.provider_major)
    print("\n".join(problems) if problems else ok)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
