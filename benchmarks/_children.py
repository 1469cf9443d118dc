"""Child processes of the side-by-side benchmarks: one process per system and workload, run one after the other
within a shared budget, each handing its rows back as JSON lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

MIN_LEFT_S = 10.0  # a child is started only with at least this many seconds of the budget left


def append_rows(path: str, rows) -> None:
    """Append ``rows`` (dicts) to ``path`` as JSON lines: what a child hands back to its parent."""
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r, default=float) + "\n")


def run(script: str, argv: list[str], child: str, label: str, deadline: float, child_timeout: float,
        env: dict | None = None) -> tuple[list[dict], str | None]:
    """Run ``python script *argv --child CHILD --rows-file FILE`` for at most ``child_timeout`` seconds and no later
    than ``deadline`` (a ``time.perf_counter()`` value).

    Returns ``(rows, error)``: the rows the child appended to FILE (kept when it fails or is stopped) and None, or
    what went wrong: the budget spent before it started, a non-zero exit, or the timeout. The child runs with
    Python's fault handler on (``PYTHONFAULTHANDLER``), so a child that crashes prints every thread's stack to the
    stderr it shares with the parent."""
    left = deadline - time.perf_counter()
    if left < MIN_LEFT_S:
        print(f"== {label}: skipped, budget spent", flush=True)
        return [], "skipped: --budget-s spent"
    timeout = min(left, child_timeout)
    print(f"== {label} (child, timeout {timeout:.0f} s)", flush=True)
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        rows_file = os.path.join(d, "rows.jsonl")
        try:
            rc = subprocess.run([sys.executable, script, *argv, "--child", child, "--rows-file", rows_file],
                                timeout=timeout, env={**(os.environ if env is None else env),
                                                      "PYTHONFAULTHANDLER": "1"}).returncode
            err = None if rc == 0 else f"child exited with {rc}"
        except subprocess.TimeoutExpired:
            err = f"child stopped after {timeout:.0f} s"
        rows = [json.loads(line) for line in open(rows_file)] if os.path.exists(rows_file) else []
    print(f"== {label}: {time.perf_counter() - t:.0f} s" + (f" ({err})" if err else ""), flush=True)
    return rows, err
