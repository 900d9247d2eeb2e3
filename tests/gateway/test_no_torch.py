"""The gateway runs on machines without torch: importing it must not import torch (DESIGN §1)."""

from __future__ import annotations

import subprocess
import sys


def test_gateway_does_not_import_torch() -> None:
    code = (
        "import sys, gateway.app, gateway.server, gateway.serve, gateway.cli; "
        "heavy = sorted(m for m in ('torch', 'triton', 'safetensors', 'transformers') if m in sys.modules); "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
