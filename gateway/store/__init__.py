"""The tenant store (SQLAlchemy 2 async; SQLite by default, PostgreSQL at scale)."""

from gateway.store.rows import Credential, normalise_url, sha256_hex
from gateway.store.store import Store

__all__ = ["Credential", "Store", "normalise_url", "sha256_hex"]
