"""Test-only: put first on `kumo serve`'s PYTHONPATH by tests/e2e/test_serve_lifecycle.py, this makes
the process send itself SIGINT (a Ctrl-C) right after its backends are ready and its store is open,
before its HTTP server runs: the window in which a Ctrl-C was once lost. Nothing in the product reads
it; the backends `kumo serve` starts run it too and do nothing."""

import os
import signal
import sys

if sys.orig_argv[1:4] == ["-m", "gateway.cli", "serve"]:
    import gateway.serve as serve

    opened = serve.open_services

    async def open_services_then_ctrl_c(*args, **kwargs):  # type: ignore[no-untyped-def]
        services = await opened(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return services

    serve.open_services = open_services_then_ctrl_c
