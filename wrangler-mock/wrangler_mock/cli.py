"""The `wrangler-mock` command: `dev`, `ai models`, `ai run`."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from wrangler_mock import __version__
from wrangler_mock.ai_commands import build_inputs, models_command, run_command
from wrangler_mock.api import CloudflareApi
from wrangler_mock.config import WranglerConfig
from wrangler_mock.dev_server import build_app, serve
from wrangler_mock.errors import ApiError, WranglerMockError
from wrangler_mock.settings import Credentials

DEFAULT_DEV_PORT = 8788


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wrangler-mock", description="A local wrangler for Python Workers on Kumo"
    )
    parser.add_argument("--version", action="version", version=f"wrangler-mock {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    dev = commands.add_parser("dev", help="serve the Worker of wrangler.toml locally")
    dev.add_argument("-c", "--config", type=Path, default=Path("wrangler.toml"))
    dev.add_argument("--port", type=int, default=DEFAULT_DEV_PORT, help="0 picks a free port")
    dev.add_argument("--ip", default="127.0.0.1")
    dev.add_argument(
        "--var", action="append", default=[], metavar="KEY:VALUE", help="extra or overriding var"
    )

    ai = commands.add_parser("ai", help="Workers AI").add_subparsers(dest="ai_command", required=True)
    models = ai.add_parser("models", help="list the model catalog")
    models.add_argument("--json", action="store_true", help="print the model objects as JSON")
    models.add_argument("-c", "--config", type=Path, default=Path("wrangler.toml"))

    run = ai.add_parser("run", help="run a model once")
    run.add_argument("model")
    run.add_argument("--prompt", required=True)
    run.add_argument("--system")
    run.add_argument("--max-tokens", type=int)
    run.add_argument("--temperature", type=float)
    run.add_argument("--stream", action="store_true", help="print the answer as it is generated")
    run.add_argument("--json", action="store_true", help="print the result (or each frame) as JSON")
    run.add_argument("--session", help="x-session-affinity value (prefix-cache locality)")
    run.add_argument("--input", default="{}", help="extra input fields as a JSON object")
    run.add_argument("-c", "--config", type=Path, default=Path("wrangler.toml"))
    return parser


def _account_from_toml(path: Path) -> str | None:
    """Like wrangler, the `ai` commands use wrangler.toml's account_id when one is around."""
    return WranglerConfig.load(path).account_id if path.is_file() else None


async def _with_api(credentials: Credentials, args: argparse.Namespace) -> int:
    async with CloudflareApi.make_client() as client:
        api = CloudflareApi(credentials, client)
        if args.ai_command == "models":
            return await models_command(api, as_json=args.json)
        extra = json.loads(args.input)
        if not isinstance(extra, dict):
            raise WranglerMockError("--input must be a JSON object")
        inputs = build_inputs(
            args.prompt,
            system=args.system,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            stream=args.stream,
            extra=extra,
        )
        return await run_command(api, args.model, inputs, session=args.session, as_json=args.json)


def _dev(credentials: Credentials, args: argparse.Namespace) -> int:
    config = WranglerConfig.load(args.config)
    for item in args.var:
        key, sep, value = item.partition(":")
        if not sep:
            raise WranglerMockError(f"--var {item!r}: expected KEY:VALUE")
        config.vars[key] = value
    app = build_app(config, credentials)
    bindings = f"  env.{config.ai_binding}  AI\n" if config.ai_binding else ""
    banner = f"Worker {config.name} ({config.main.name})\n" + (
        f"Your Worker has access to the following bindings:\n{bindings}" if bindings else ""
    )
    asyncio.run(serve(app, args.ip, args.port, banner=banner))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    credentials = Credentials.from_env()
    try:
        if args.command == "dev":
            return _dev(credentials, args)
        credentials = credentials.with_account_fallback(_account_from_toml(args.config))
        return asyncio.run(_with_api(credentials, args))
    except ApiError as exc:
        print(f"✘ [ERROR] {exc.wrangler_text}", file=sys.stderr, flush=True)
        return 1
    except WranglerMockError as exc:
        print(f"✘ [ERROR] {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
