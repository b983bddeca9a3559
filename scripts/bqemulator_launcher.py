#!/usr/bin/env python3
"""Start bqemulator without DuckDB's ``spatial`` extension.

bqemulator loads DuckDB's ``spatial`` extension at start-up (for GEOGRAPHY)
and downloads it from the DuckDB extension repository when it is not cached.
That host is unreachable here (and on CI), so start-up would fail. This
launcher replaces ``DuckDBEngine._load_spatial`` with a no-op (GEOGRAPHY/ST_*
functions are then unavailable, which this project does not use) and runs
bqemulator's normal console entry point (``bqemulator = bqemulator.cli:main``)
with the given arguments, e.g.::

    python bqemulator_launcher.py start --rest-host 127.0.0.1 --rest-port 9050

Used by ``scripts/services``; run it with the venv's python.
"""

from __future__ import annotations

import sys


def _patch_spatial() -> None:
    from bqemulator.storage.engine import DuckDBEngine

    def _load_spatial_noop(self: DuckDBEngine) -> None:  # noqa: ARG001
        return None

    DuckDBEngine._load_spatial = _load_spatial_noop  # type: ignore[method-assign]


def main() -> None:
    _patch_spatial()
    from bqemulator.cli import main as bqemulator_main

    sys.argv[0] = "bqemulator"
    bqemulator_main()


if __name__ == "__main__":
    main()
