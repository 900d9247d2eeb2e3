"""`kumo bench SUBCOMMAND ...`: the end-to-end benchmarks (gateway/cli.py maps `bench` here).

Each subcommand lives in its own module with a `main(argv) -> int`, imported only when called, so
`kumo bench` stays free of torch (and of msgspec) until a subcommand needs them.
"""

from __future__ import annotations

import importlib
import sys

# subcommand → module with `main(argv: list[str]) -> int`
SUBCOMMANDS: dict[str, str] = {
    "attack": "benchmarks.attack",
    "engine": "benchmarks.engine.cli",
    "load": "benchmarks.load",
    "report": "benchmarks.report",
    "serve": "benchmarks.serve",
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    usage = "usage: kumo bench {" + ",".join(SUBCOMMANDS) + "} [options]"
    if not args or args[0] in ("-h", "--help"):
        print(usage)
        return 0 if args else 2
    if args[0] not in SUBCOMMANDS:
        print(f"kumo bench: unknown subcommand {args[0]!r}\n{usage}", file=sys.stderr)
        return 2
    return int(importlib.import_module(SUBCOMMANDS[args[0]]).main(args[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
