"""wrangler.toml (and .dev.vars beside it): the parts of a Worker's configuration wrangler-mock uses."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wrangler_mock.errors import ConfigError


@dataclass(frozen=True)
class WranglerConfig:
    """A Worker's name, entry module, account, AI binding name and plain-text vars.

    `vars` holds `[vars]` with `.dev.vars` layered on top, as `wrangler dev` does for local
    secrets. `ai_binding` is None when the toml has no `[ai]` table (the Worker then gets no AI).
    """

    name: str
    main: Path
    account_id: str | None = None
    ai_binding: str | None = None
    vars: dict[str, Any] = field(default_factory=dict)
    compatibility_flags: tuple[str, ...] = ()

    @classmethod
    def load(cls, path: Path) -> WranglerConfig:
        path = Path(path)
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(f"no wrangler config at {path}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        return cls.from_dict(raw, base_dir=path.parent)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, base_dir: Path) -> WranglerConfig:
        name, main = raw.get("name"), raw.get("main")
        if not isinstance(name, str) or not name:
            raise ConfigError('wrangler.toml needs a "name"')
        if not isinstance(main, str) or not main:
            raise ConfigError('wrangler.toml needs "main", the Worker\'s entry module (e.g. "src/entry.py")')
        ai = raw.get("ai")
        if ai is not None and not (isinstance(ai, dict) and isinstance(ai.get("binding"), str)):
            raise ConfigError('[ai] needs a string "binding", e.g. binding = "AI"')
        raw_vars = raw.get("vars", {})
        if not isinstance(raw_vars, dict):
            raise ConfigError("[vars] must be a table")
        account_id = raw.get("account_id")
        return cls(
            name=name,
            main=(base_dir / main).resolve(),
            account_id=str(account_id) if account_id else None,
            ai_binding=ai["binding"] if ai else None,
            vars={**raw_vars, **read_dev_vars(base_dir / ".dev.vars")},
            compatibility_flags=tuple(raw.get("compatibility_flags", ())),
        )


def read_dev_vars(path: Path) -> dict[str, str]:
    """`.dev.vars` in dotenv form: `KEY=value` lines, `#` comments, optional quotes around values."""
    if not path.is_file():
        return {}
    result: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{path}:{number}: expected KEY=value")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        result[key.strip()] = value
    return result
