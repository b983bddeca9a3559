"""Every path a document names exists (deploy/check): ARCHITECTURE.md and README.md must describe
the code as it is, so a moved or renamed file fails the check instead of leaving the document wrong.

A name in backticks is checked when it looks like a path of this repository:
- it starts with a top-level entry (`dispatcher/src/batch/mod.rs`, `scripts/chaos`): it must exist;
- it is relative to a context the text gives (`bigquery/`, `src/bin/outbox-chaos/`: it ends with
  `/`) or a bare file name (`batch.rs`, `claim_ordered.sql`): some tracked path must end with it.
URLs, endpoints (`/healthz`) and anything with spaces, wildcards or placeholders are not paths.

Usage: doc_paths.py REPO DOCUMENT...
"""

import re
import subprocess
import sys
from pathlib import Path

TICKED = re.compile(r"`([^`\s]+)`")
PATHLIKE = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*/?$")
# Files of the repository are named with these (a `report.json` or a credentials file is a file a
# run writes, not one of ours).
FILE_SUFFIXES = (".rs", ".sql", ".md", ".toml", ".tf", ".py", ".yaml", ".yml")


def tracked(repo: Path) -> list[str]:
    """The repository's files as the working tree has them: tracked or new (not ignored), not
    deleted, so a check run before a commit judges the documents against the files they describe."""
    def git(*args: str) -> set[str]:
        out = subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout
        return {line for line in out.splitlines() if line}

    try:
        return sorted((git("ls-files") | git("ls-files", "--others", "--exclude-standard")) - git("ls-files", "--deleted"))
    except (OSError, subprocess.CalledProcessError):
        return [str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts]


def candidates(text: str, top_level: set[str]):
    for match in TICKED.finditer(text):
        name = match.group(1)
        if "://" in name or name.startswith("/") or not PATHLIKE.match(name):
            continue
        first = name.split("/")[0]
        is_file = name.endswith(FILE_SUFFIXES) and not name.startswith(".")
        # A relative name is a path when it ends as a file or a directory does
        # (`max_outstanding_messages/bytes` is not one).
        if is_file or name.endswith("/") or ("/" in name and first in top_level):
            yield text.count("\n", 0, match.start()) + 1, name


def main() -> int:
    repo = Path(sys.argv[1]).resolve()
    files = tracked(repo)
    dirs = {str(Path(f).parent) + "/" for f in files}
    for f in files:
        parts = Path(f).parts
        for i in range(1, len(parts)):
            dirs.add("/".join(parts[:i]) + "/")
    top = {Path(f).parts[0] for f in files}
    missing = []
    for document in sys.argv[2:]:
        text = (repo / document).read_text(encoding="utf-8")
        for line, name in candidates(text, top):
            first = name.split("/")[0]
            if "/" in name and first in top:
                ok = (repo / name).exists()
            else:
                bare = name.rstrip("/")
                ok = any(f == bare or f.endswith("/" + bare) for f in files) or any(
                    d == name or d.endswith("/" + name) for d in dirs
                )
            if not ok:
                missing.append(f"{document}:{line}: `{name}` names no file or directory of the repository")
    for m in missing:
        print(m)
    if missing:
        print(f"{len(missing)} path(s) named by the documents do not exist: fix the document (or the name)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
