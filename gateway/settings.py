"""GatewaySettings: the one frozen configuration object, built once from argv and the environment.

Flags win over `KUMO_*` environment variables, which win over defaults. Nothing else in the gateway
reads `os.environ`; everything is handed this object.
"""

from __future__ import annotations

import argparse
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

MIB = 1024 * 1024


@dataclass(frozen=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8787
    data_dir: Path = Path(".kumo")
    catalog_file: Path | None = None  # None: the default catalog shipped in the package
    pools_file: Path | None = None
    database_url: str | None = None  # None: SQLite in data_dir
    redis_url: str | None = None  # None: in-process rate limits
    admin_token: str | None = None
    server_secret: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)
    max_body_bytes: int = 10 * MIB
    max_image_bytes: int = 10 * MIB
    max_images: int = 8
    # a request's image bytes times its choices (each choice's backend request carries every image,
    # base64 in JSON): 8 choices of 8 fetched 10 MB images held ~0.9 GB and a second of the event
    # loop; one choice may still carry `max_images` images of `max_image_bytes`
    max_image_bytes_total: int = 80 * MIB
    max_image_pixels: int = 4096 * 4096
    image_fetch_timeout_s: float = 10.0
    image_max_redirects: int = 5
    allow_private_urls: bool = False
    allowed_image_networks: tuple[str, ...] = ()  # CIDRs image URLs may reach even if private
    max_choices: int = 8
    health_interval_s: float = 2.0
    eject_after_failures: int = 2
    backend_connect_timeout_s: float = 5.0
    backend_read_timeout_s: float = 600.0
    body_read_timeout_s: float = 30.0
    # connection limits, enforced before any request reaches the app (schemas/http_protocol.py)
    header_timeout_s: float = 10.0  # request line + headers must arrive within this (else 408, closed)
    max_header_bytes: int = 32 * 1024  # request line + headers (else 431)
    max_connections: int = 1024  # open connections per gateway process (more: 503, closed at once)
    # of which one client (IPv4 address, IPv6 /64) may hold (0: no cap; behind a proxy, set 0)
    max_connections_per_client: int = 512
    keep_alive_timeout_s: int = 15  # an idle connection after a response is closed after this
    log_json: bool = True
    request_timeout_s: float = 600.0  # wall-clock limit of one generation (408/3046)
    drain_timeout_s: float = 30.0  # SIGTERM: running requests get this long before 3008
    batch_result_ttl_s: float = 86400.0  # async batch: how long finished results are kept
    batch_lease_s: float = 60.0  # a running job whose gateway stops renewing is retried after this
    batch_poll_interval_s: float = 1.0
    batch_concurrency: int = 4  # batch requests in flight at once, shared round-robin by tenant
    batch_max_jobs: int = 16  # jobs one gateway runs at once, at most one per tenant
    batch_priority: int = 5  # the internal request's priority (0 interactive, higher later)
    batch_max_pending_per_tenant: int = 16  # unfinished jobs one account may have queued (0: no cap)
    # bytes one account's kept jobs (requests and results, until purged) may hold (0: no cap)
    batch_max_stored_bytes_per_tenant: int = 256 * MIB

    @property
    def sqlite_url(self) -> str:
        return f"sqlite+aiosqlite:///{(self.data_dir / 'kumo.db').resolve()}"

    @property
    def effective_database_url(self) -> str:
        return self.database_url or self.sqlite_url


def add_common_arguments(parser: argparse.ArgumentParser, *, default_port: int) -> None:
    """Flags shared by `kumo serve` and `kumo gateway`."""
    parser.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help=f"listen port (default {default_port})")
    parser.add_argument("--data-dir", type=Path, default=None, help="state folder (default .kumo)")
    parser.add_argument(
        "--database-url", default=None, help="SQLAlchemy URL (default SQLite in the data dir)"
    )
    parser.add_argument("--redis-url", default=None, help="Redis URL for shared rate limits")
    parser.add_argument(
        "--allow-private-urls",
        action="store_true",
        default=None,
        help="let image URLs reach loopback/private addresses (tests only)",
    )


def settings_from(
    args: argparse.Namespace, env: Mapping[str, str] | None = None, **overrides: object
) -> GatewaySettings:
    """Build the settings from parsed flags and the environment (`KUMO_*`; the process's own
    unless `env` is given). The only place the gateway reads the environment."""
    env = os.environ if env is None else env

    def pick(flag: object, name: str, default: object) -> object:
        if flag is not None:
            return flag
        return env.get(name, default)

    base = GatewaySettings()
    values: dict[str, object] = {
        "host": pick(getattr(args, "host", None), "KUMO_HOST", base.host),
        "port": int(str(pick(getattr(args, "port", None), "KUMO_PORT", base.port))),
        "data_dir": Path(str(pick(getattr(args, "data_dir", None), "KUMO_DATA_DIR", base.data_dir))),
        "database_url": pick(getattr(args, "database_url", None), "KUMO_DATABASE_URL", None),
        "redis_url": pick(getattr(args, "redis_url", None), "KUMO_REDIS_URL", None),
        "admin_token": env.get("KUMO_ADMIN_TOKEN") or None,
        "allow_private_urls": bool(getattr(args, "allow_private_urls", None))
        or env.get("KUMO_ALLOW_PRIVATE_URLS", "") in ("1", "true"),
    }
    if env.get("KUMO_ALLOWED_IMAGE_NETWORKS"):
        values["allowed_image_networks"] = tuple(
            n.strip() for n in env["KUMO_ALLOWED_IMAGE_NETWORKS"].split(",") if n.strip()
        )
    values["server_secret"] = env.get("KUMO_SERVER_SECRET") or persisted_secret(Path(str(values["data_dir"])))
    for name in (
        "max_body_bytes",
        "max_image_bytes_total",
        "batch_max_stored_bytes_per_tenant",
        "max_header_bytes",
        "max_connections",
        "max_connections_per_client",
        "keep_alive_timeout_s",
    ):
        if env.get(f"KUMO_{name.upper()}"):
            values[name] = int(env[f"KUMO_{name.upper()}"])
    for name in (
        "request_timeout_s",
        "drain_timeout_s",
        "batch_result_ttl_s",
        "batch_lease_s",
        "header_timeout_s",
    ):
        if env.get(f"KUMO_{name.upper()}"):
            values[name] = float(env[f"KUMO_{name.upper()}"])
    if env.get("KUMO_BATCH_MAX_PENDING_PER_TENANT"):
        values["batch_max_pending_per_tenant"] = int(env["KUMO_BATCH_MAX_PENDING_PER_TENANT"])
    values.update(overrides)
    return replace(base, **values)  # type: ignore[arg-type]


def child_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """The environment for a spawned backend: ours plus `extra` (its secret travels here, not on
    the command line where `ps` would show it)."""
    return {**os.environ, **extra}


def persisted_secret(data_dir: Path) -> str:
    """The server secret kept in the data dir, created on first use. Gateways that share a data
    dir (or `KUMO_SERVER_SECRET`) derive the same tenant salts, so prefix caches stay warm."""
    path = data_dir / "server_secret"
    if path.is_file():
        return path.read_text().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    value = secrets.token_hex(32)
    if not write_private_file(path, value):
        return path.read_text().strip()  # another gateway created it first: share its secret
    return value


def stage_private_file(path: Path, data: bytes) -> Path:
    """A fresh file beside `path` holding `data`, readable by its owner only from the first byte on
    (`os.open` with 0o600: no moment of umask-default permissions), flushed to disk; the caller links
    or renames it into place."""
    staging = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    return staging


def write_private_file(path: Path, text: str) -> bool:
    """Create `path` holding `text`, owner-only from the first byte on; False (and nothing written) if
    it already exists. The staged file is hard-linked into place, so a reader never sees it half
    written and two creators never overwrite each other."""
    staging = stage_private_file(path, text.encode())
    try:
        os.link(staging, path)
    except FileExistsError:
        return False
    finally:
        staging.unlink(missing_ok=True)
    return True
