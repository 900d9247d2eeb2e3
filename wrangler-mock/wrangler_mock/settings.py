"""Cloudflare credentials, read from the environment once, the way wrangler reads them.

This is the only module that looks at `os.environ`; everything else receives a `Credentials`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_API_BASE_URL = "https://api.cloudflare.com/client/v4"

# wrangler's names, each with its deprecated CF_* alias (workers-utils misc-variables.ts)
_BASE_URL_VARS = ("CLOUDFLARE_API_BASE_URL", "CF_API_BASE_URL")
_TOKEN_VARS = ("CLOUDFLARE_API_TOKEN", "CF_API_TOKEN")
_ACCOUNT_VARS = ("CLOUDFLARE_ACCOUNT_ID", "CF_ACCOUNT_ID")
_KEY_VARS = ("CLOUDFLARE_API_KEY", "CF_API_KEY")
_EMAIL_VARS = ("CLOUDFLARE_EMAIL", "CF_EMAIL")


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    for name in names:
        value = environ.get(name)
        if value:
            return value
    return None


@dataclass(frozen=True)
class Credentials:
    """Where the Cloudflare API is and how to authenticate to it.

    `account_id` from the environment wins over wrangler.toml's (`with_account_fallback`), as it
    does for wrangler in CI.
    """

    api_base_url: str = DEFAULT_API_BASE_URL
    api_token: str | None = None
    api_key: str | None = None
    email: str | None = None
    account_id: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Credentials:
        env = os.environ if environ is None else environ
        return cls(
            api_base_url=(_first(env, _BASE_URL_VARS) or DEFAULT_API_BASE_URL).rstrip("/"),
            api_token=_first(env, _TOKEN_VARS),
            api_key=_first(env, _KEY_VARS),
            email=_first(env, _EMAIL_VARS),
            account_id=_first(env, _ACCOUNT_VARS),
        )

    def with_account_fallback(self, account_id: str | None) -> Credentials:
        """These credentials, taking `account_id` (e.g. wrangler.toml's) only if none was set."""
        if self.account_id or not account_id:
            return self
        return Credentials(self.api_base_url, self.api_token, self.api_key, self.email, account_id)

    def auth_headers(self) -> dict[str, str]:
        """wrangler's order: an API token (Bearer), else the global key + email pair."""
        if self.api_token:
            return {"Authorization": f"Bearer {self.api_token}"}
        if self.api_key and self.email:
            return {"X-Auth-Key": self.api_key, "X-Auth-Email": self.email}
        return {}
