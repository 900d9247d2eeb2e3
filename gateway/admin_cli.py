"""`kumo admin …`: the tenant admin API from the shell, over HTTP (httpx).

The gateway's URL comes from `--url` (or `KUMO_URL`), the admin token from `KUMO_ADMIN_TOKEN`;
both are read once, here, into `CliSettings`. Each command prints the envelope's `result` as JSON
on stdout (so it pipes into `jq`) and exits 0; an API error prints `error CODE: message` on stderr
and exits 1; a usage error exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

DEFAULT_URL = "http://127.0.0.1:8787"
QUOTA_KEYS = ("requests_per_minute", "tokens_per_minute", "daily_neurons")


@dataclass(frozen=True)
class CliSettings:
    url: str
    admin_token: str


def _limit(text: str) -> int | None:
    try:
        return None if text.lower() in ("none", "null", "unlimited") else int(text)
    except ValueError:  # argparse would name this function ("invalid _limit value")
        raise argparse.ArgumentTypeError(f"expected a whole number or 'none', got {text!r}") from None


def _neurons(text: str) -> float | None:
    try:
        return None if text.lower() in ("none", "null", "unlimited") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {text!r}") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kumo admin", description="Manage tenants, tokens, quotas and usage.")
    p.add_argument("--url", default=None, help=f"gateway URL (default $KUMO_URL or {DEFAULT_URL})")
    # `--url` is accepted after the command too (`kumo admin tenants list --url ...`)
    url = argparse.ArgumentParser(add_help=False)
    url.add_argument("--url", default=argparse.SUPPRESS, help="gateway URL")
    sub = p.add_subparsers(dest="command", required=True)

    tenants = sub.add_parser(
        "tenants", help="create, list, show, update, suspend, resume, delete tenants"
    ).add_subparsers(dest="action", required=True)
    t_list = tenants.add_parser("list", parents=[url])
    t_list.add_argument("--page", type=int, default=1)
    t_list.add_argument("--per-page", type=int, default=50)
    t_create = tenants.add_parser("create", parents=[url])
    t_create.add_argument("name")
    t_create.add_argument("--plan", choices=["free", "paid"], default="free")
    tenants.add_parser("show", parents=[url]).add_argument("tenant_id")
    t_update = tenants.add_parser("update", parents=[url])
    t_update.add_argument("tenant_id")
    t_update.add_argument("--name")
    t_update.add_argument(
        "--plan",
        choices=["free", "paid"],
        help="the plan; a change resets daily neurons to the plan's default (set it after with `quotas`)",
    )
    tenants.add_parser(
        "suspend", parents=[url], help="refuse the tenant's tokens (403) and hold its batch jobs"
    ).add_argument("tenant_id")
    tenants.add_parser("resume", parents=[url], help="undo a suspension").add_argument("tenant_id")
    tenants.add_parser("delete", parents=[url]).add_argument("tenant_id")

    tokens = sub.add_parser("tokens", help="create, list, revoke a tenant's tokens").add_subparsers(
        dest="action", required=True
    )
    tokens.add_parser("list", parents=[url]).add_argument("tenant_id")
    k_create = tokens.add_parser("create", parents=[url])
    k_create.add_argument("tenant_id")
    k_create.add_argument("name")
    k_create.add_argument("--expires-at", help="RFC 3339 time with zone, e.g. 2027-01-01T00:00:00Z")
    k_revoke = tokens.add_parser("revoke", parents=[url])
    k_revoke.add_argument("tenant_id")
    k_revoke.add_argument("token_id")

    quotas = sub.add_parser(
        "quotas", parents=[url], help="change a tenant's quotas ('none' = unlimited; the others are kept)"
    )
    quotas.add_argument("tenant_id")
    quotas.add_argument("--requests-per-minute", type=_limit, default=argparse.SUPPRESS)
    quotas.add_argument("--tokens-per-minute", type=_limit, default=argparse.SUPPRESS)
    quotas.add_argument("--daily-neurons", type=_neurons, default=argparse.SUPPRESS)

    models = sub.add_parser("models", parents=[url], help="set a tenant's model allow-list")
    models.add_argument("tenant_id")
    group = models.add_mutually_exclusive_group(required=True)
    group.add_argument("--allow", nargs="*", metavar="MODEL", help="the only models the tenant may use")
    group.add_argument("--all", action="store_true", help="allow every model")

    usage = sub.add_parser("usage", parents=[url], help="a tenant's usage per day or per model")
    usage.add_argument("tenant_id")
    usage.add_argument("--since", help="YYYY-MM-DD (default 29 days before --until)")
    usage.add_argument("--until", help="YYYY-MM-DD (default today, UTC)")
    usage.add_argument("--group-by", choices=["day", "model"], default="day")

    audit = sub.add_parser("audit", parents=[url], help="admin actions, newest first")
    audit.add_argument("--page", type=int, default=1)
    audit.add_argument("--per-page", type=int, default=50)
    audit.add_argument("--tenant-id")
    return p


def request_of(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None, dict[str, Any]]:
    """The (method, path, JSON body, query) that a parsed command stands for."""
    tenant = f"/tenants/{getattr(args, 'tenant_id', '')}"
    match args.command, getattr(args, "action", None):
        case "tenants", "list":
            return "GET", "/tenants", None, {"page": args.page, "per_page": args.per_page}
        case "tenants", "create":
            return "POST", "/tenants", {"name": args.name, "plan": args.plan}, {}
        case "tenants", "show":
            return "GET", tenant, None, {}
        case "tenants", "update":
            body = {k: v for k, v in (("name", args.name), ("plan", args.plan)) if v is not None}
            return "PATCH", tenant, body, {}
        case "tenants", "suspend" | "resume":
            return "PATCH", tenant, {"suspended": args.action == "suspend"}, {}
        case "tenants", "delete":
            return "DELETE", tenant, None, {}
        case "tokens", "list":
            return "GET", f"{tenant}/tokens", None, {}
        case "tokens", "create":
            body = {"name": args.name} | ({"expires_at": args.expires_at} if args.expires_at else {})
            return "POST", f"{tenant}/tokens", body, {}
        case "tokens", "revoke":
            return "DELETE", f"{tenant}/tokens/{args.token_id}", None, {}
        case "quotas", _:
            body = {k: getattr(args, k) for k in QUOTA_KEYS if hasattr(args, k)}
            return "PATCH", f"{tenant}/quotas", body, {}
        case "models", _:
            return "PUT", f"{tenant}/models", {"allow": None if args.all else list(args.allow)}, {}
        case "usage", _:
            query = {"since": args.since, "until": args.until, "group_by": args.group_by}
            return "GET", f"{tenant}/usage", None, {k: v for k, v in query.items() if v is not None}
        case "audit", _:
            query = {"page": args.page, "per_page": args.per_page, "tenant_id": args.tenant_id}
            return "GET", "/audit", None, {k: v for k, v in query.items() if v is not None}
    raise AssertionError(f"unhandled command {args.command} {getattr(args, 'action', '')}")


def main(
    argv: list[str], env: Mapping[str, str] | None = None, transport: httpx.BaseTransport | None = None
) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.command == "quotas" and not any(hasattr(args, k) for k in QUOTA_KEYS):
        p.error("quotas: give at least one of --requests-per-minute, --tokens-per-minute, --daily-neurons")
    env = os.environ if env is None else env
    token = env.get("KUMO_ADMIN_TOKEN")
    if not token:
        print("kumo admin: set KUMO_ADMIN_TOKEN to the gateway's admin token", file=sys.stderr)
        return 2
    settings = CliSettings(
        url=(args.url or env.get("KUMO_URL") or DEFAULT_URL).rstrip("/"), admin_token=token
    )
    method, path, body, query = request_of(args)
    headers = {"authorization": f"Bearer {settings.admin_token}"}
    try:
        with httpx.Client(
            base_url=f"{settings.url}/admin/v1", transport=transport, trust_env=False
        ) as client:
            response = client.request(method, path, json=body, params=query, headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        print(f"kumo admin: cannot reach {settings.url}: {exc}", file=sys.stderr)
        return 1
    try:
        envelope = msgspec.json.decode(response.content)
    except msgspec.DecodeError:
        print(f"kumo admin: HTTP {response.status_code}, not a JSON envelope", file=sys.stderr)
        return 1
    if response.is_success and isinstance(envelope, dict) and envelope.get("success"):
        sys.stdout.write(
            msgspec.json.format(msgspec.json.encode(envelope.get("result")), indent=2).decode() + "\n"
        )
        return 0
    errors = envelope.get("errors") if isinstance(envelope, dict) else None
    for error in errors or [{"code": response.status_code, "message": response.reason_phrase}]:
        print(f"error {error.get('code')}: {error.get('message')}", file=sys.stderr)
    return 1
