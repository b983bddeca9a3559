#!/usr/bin/env python3
"""Licence allowlist check for the crates the binaries ship.

Usage: check.py METADATA_JSON [ABOUT_TOML]

METADATA_JSON is `cargo metadata --format-version 1 --locked --filter-platform
x86_64-unknown-linux-gnu` output. Walks the resolved graph from the workspace members through
normal and build dependencies (dev dependencies never ship) and checks each crate's SPDX licence
expression against `accepted` in about.toml (the same list cargo-about uses for
THIRD_PARTY_LICENSES). Prints one line per licence with its crate count, and every crate that
fails; exits 1 if any does.
"""
import json
import re
import sys
import tomllib
from pathlib import Path

# Crates whose manifest has no `license` (only a license file), with the expression read from
# that file. Add an entry only after reading the crate's licence file.
CLARIFIED: dict[str, str] = {}


def tokens(expr: str) -> list[str]:
    # Old crates write "MIT/Apache-2.0" for "MIT OR Apache-2.0".
    return re.findall(r"\(|\)|[^\s()]+", expr.replace("/", " OR "))


def satisfied(expr: str, accepted: set[str]) -> bool:
    """Evaluates an SPDX expression: OR needs one side accepted, AND both; `X WITH exception`
    is accepted as written or when X is (an exception only adds permissions)."""
    toks = tokens(expr)
    pos = 0

    def peek() -> str | None:
        return toks[pos] if pos < len(toks) else None

    def take() -> str:
        nonlocal pos
        pos += 1
        return toks[pos - 1]

    def primary() -> bool:
        if peek() == "(":
            take()
            value = disjunction()
            if take() != ")":
                raise ValueError(f"unbalanced parentheses in {expr!r}")
            return value
        licence = take().removesuffix("+")
        if peek() == "WITH":
            take()
            exception = take()
            return f"{licence} WITH {exception}" in accepted or licence in accepted
        return licence in accepted

    def conjunction() -> bool:
        value = primary()
        while peek() == "AND":
            take()
            value = primary() and value
        return value

    def disjunction() -> bool:
        value = conjunction()
        while peek() == "OR":
            take()
            value = conjunction() or value
        return value

    result = disjunction()
    if pos != len(toks):
        raise ValueError(f"cannot parse licence expression {expr!r}")
    return result


def shipped(metadata: dict) -> list[dict]:
    packages = {p["id"]: p for p in metadata["packages"]}
    nodes = {n["id"]: n for n in metadata["resolve"]["nodes"]}
    members = set(metadata["workspace_members"])
    seen: set[str] = set()
    todo = list(members)
    while todo:
        node = nodes[todo.pop()]
        for dep in node["deps"]:
            kinds = {k["kind"] for k in dep["dep_kinds"]}
            if kinds & {None, "build"} and dep["pkg"] not in seen:
                seen.add(dep["pkg"])
                todo.append(dep["pkg"])
    return [packages[i] for i in sorted(seen - members)]


def main() -> int:
    metadata = json.loads(Path(sys.argv[1]).read_text())
    about = Path(sys.argv[2] if len(sys.argv) > 2 else Path(__file__).with_name("about.toml"))
    accepted = set(tomllib.loads(about.read_text())["accepted"])
    by_licence: dict[str, int] = {}
    failures = []
    for package in shipped(metadata):
        expr = package.get("license") or CLARIFIED.get(package["name"])
        if not expr:
            failures.append(f"{package['name']} {package['version']}: no licence expression "
                            "(read its licence file, then add it to CLARIFIED)")
            continue
        by_licence[expr] = by_licence.get(expr, 0) + 1
        if not satisfied(expr, accepted):
            failures.append(f"{package['name']} {package['version']}: {expr} is not in the allowlist")
    for expr, count in sorted(by_licence.items(), key=lambda kv: -kv[1]):
        print(f"  {count:4} {expr}")
    for failure in failures:
        print(f"  FAIL {failure}")
    print(f"  {sum(by_licence.values())} crates checked against {about.name}, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
