"""What deploy/check's Python checks share: their command line (the check on the repository, or
its self-test on broken copies) and how a self-test reports a copy it did not refuse.

A check module defines `check(path) -> (problems, summary)` and `self_test(path)`, and ends with
`selfcheck.main(check, self_test)`.
"""

import sys
from pathlib import Path


def not_refused(what: str, problems: list[str], expected: str) -> list[str]:
    """The self-test's failure when no problem of a broken copy says `expected` (none if one does)."""
    if any(expected in p for p in problems):
        return []
    return [f"{what}: not refused with {expected!r} (got {problems or 'no problem'})"]


def finish(failures: list[str], summary: str) -> None:
    """Exits with the failures, or prints the summary."""
    if failures:
        sys.exit("\n".join(failures))
    print(summary)


def main(check, self_test) -> None:
    """`NAME.py PATH` runs the check, `NAME.py --self-test PATH` its self-test."""
    if sys.argv[1] == "--self-test":
        self_test(Path(sys.argv[2]).resolve())
        return
    problems, summary = check(Path(sys.argv[1]).resolve())
    finish(problems, summary)
