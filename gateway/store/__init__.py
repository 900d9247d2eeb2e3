"""The tenant store (SQLAlchemy 2 async; SQLite by default, PostgreSQL at scale)."""

from gateway.store.store import Credential, Store, normalise_url, sha256_hex

__all__ = ["Credential", "Store", "normalise_url", "sha256_hex"]
