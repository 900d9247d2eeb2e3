"""Merge kernel-benchmark records into the one file issue 6 asks for (`kernels-h200.json`).

    python -m benchmarks.kernels.merge OUT.json RECORD.json [RECORD.json ...]

A RECORD may itself be a merged file (it has `runs`): its runs are taken as they are, its rows keep
theirs, so new records merge into the existing file without its sources:

    python -m benchmarks.kernels.merge benchmarks/results/kernels-h200.json \
        benchmarks/results/kernels-h200.json NEW.json [NEW.json ...]

Each benchmark measures its own ceilings in its own run; the merged file keeps them all: `runs` lists
every source record's command, date, device and ceilings, each row names its run (`run`, an index
into `runs`), and its `fraction_of_ceiling` stays the one computed against that run's ceilings. The
top-level `ceilings` are the first run's (the schema's single object). A later record replaces an
earlier one's rows of the same (kernel, case), so re-measured cases keep only their newest figure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def merge(records: list[dict[str, Any]]) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for record in records:
        index = len(runs)
        if "runs" in record:  # an earlier merge: its runs as they are, each row keeps its own
            runs += record["runs"]
            for row in record["rows"]:
                rows[(row["kernel"], row["case"])] = row | {"run": index + row["run"]}
            continue
        runs.append(
            {k: record.get(k) for k in ("command", "date", "device", "versions", "ceilings", "notes")}
        )
        for row in record["rows"]:
            rows[(row["kernel"], row["case"])] = row | {"run": index}
    if not runs:
        raise ValueError("no records to merge")
    return {
        "command": "python -m benchmarks.kernels.merge (the runs' own commands are under runs[])",
        "date": max(str(r["date"]) for r in runs),
        "device": runs[0]["device"],
        "ceilings": runs[0]["ceilings"],
        "runs": runs,
        "rows": list(rows.values()),
    }


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, *paths = argv
    records = [json.loads(Path(p).read_text()) for p in paths]
    Path(out).write_text(json.dumps(merge(records), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
