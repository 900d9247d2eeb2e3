"""The hostile-load suite (issue 27): each test mounts one attack, bounded in count and time, on
localhost only, prints what it tried and what it got, and asserts the defended behaviour. It reuses
the gateway tests' harness and fake backends, whose folder is put on the import path here."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gateway"))

# One fake-backed gateway for the whole suite (a fixture imported into each module would start one per module).
from gateway_harness import harness  # noqa: E402, F401
