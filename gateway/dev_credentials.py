"""The development credentials `kumo serve` prints: the development account, its API token and the
admin token, kept from one start to the next in the data dir.

The store keeps only hashes, so the plaintext values live in `dev-credentials.json`, created
owner-only (0600) from the first byte and swapped in with a rename, so no reader ever sees a half
file or a wider mode. A value that was revoked (through the admin API) or replaced (by
`KUMO_ADMIN_TOKEN`) is checked against the store on every start and never brought back.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from gateway.settings import GatewaySettings, stage_private_file
from gateway.store.store import Store

FILE_NAME = "dev-credentials.json"


class DevCredentials(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """What the file holds. `admin_token` is None when the admin token is one the operator chose
    (`KUMO_ADMIN_TOKEN`, never written down) or one generated before this file existed."""

    account_id: str
    api_token: str
    admin_token: str | None = None


def credentials_path(settings: GatewaySettings) -> Path:
    return settings.data_dir / FILE_NAME


def read_credentials(path: Path) -> DevCredentials | None:
    """The saved credentials, or None when there are none (or the file is not ours to parse)."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=DevCredentials)
    except (FileNotFoundError, msgspec.DecodeError):
        return None


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically, the file mode 0600 from its creation on (replacing it)."""
    staging = stage_private_file(path, data)
    try:
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


async def ensure_dev_credentials(store: Store, settings: GatewaySettings) -> DevCredentials:
    """The development tenant with a live token and the admin token, reusing what the previous
    start on this data dir wrote down while the store still accepts it; the file is rewritten
    when anything changed."""
    path = credentials_path(settings)
    saved = read_credentials(path)
    admin_token = await store.ensure_admin_token(settings.admin_token)
    if admin_token is None and saved is not None and saved.admin_token is not None:
        # kept while the store accepts it: also when the shell exported it as KUMO_ADMIN_TOKEN,
        # as the announcement suggests; a different KUMO_ADMIN_TOKEN has replaced it
        is_live = await store.resolve_admin(saved.admin_token) is not None
        admin_token = saved.admin_token if is_live else None
    account_id, api_token = await store.ensure_dev_tenant(keep=saved.api_token if saved else None)
    current = DevCredentials(account_id=account_id, api_token=api_token, admin_token=admin_token)
    if current != saved:
        write_private(path, msgspec.json.encode(current) + b"\n")
    return current
