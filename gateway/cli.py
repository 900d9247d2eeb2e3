"""The `kumo` command: a thin dispatcher.

`serve`, `gateway` and `admin` live in the gateway; `backend`, `quantize`, `plan`, `eval` and `bench`
import the backend (and torch) only when called, so the gateway runs on machines without torch.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

# command → module with a `main(argv: list[str]) -> int`
COMMANDS: dict[str, str] = {
    "serve": "gateway.serve",
    "gateway": "gateway.server",
    "admin": "gateway.admin_cli",
    "backend": "backend.server.app",
    "quantize": "backend.tools.quantize",
    "plan": "backend.tools.plan",
    "eval": "backend.tools.eval",
    "bench": "benchmarks.cli",
}

USAGE = "usage: kumo {" + ",".join(COMMANDS) + "} [options]  (kumo COMMAND --help for each)"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"kumo: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[command])
        return int(module.main(rest) or 0)
    except KeyboardInterrupt:  # Ctrl-C: stopped as asked; a key press is not a crash to trace
        # die by SIGINT, as an untraced interrupt would: a calling shell script then stops too
        # (an exit code of 130 would tell it the command handled the signal, and the script goes on)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
