"""wrangler.toml, .dev.vars and credential resolution, as wrangler reads them."""

from __future__ import annotations

from pathlib import Path

import pytest
from wrangler_mock.api import _query
from wrangler_mock.config import WranglerConfig
from wrangler_mock.errors import ConfigError
from wrangler_mock.settings import DEFAULT_API_BASE_URL, Credentials


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_reads_name_main_account_binding_and_vars(tmp_path: Path) -> None:
    toml = write(
        tmp_path / "wrangler.toml",
        'name = "w"\nmain = "src/entry.py"\naccount_id = "abc"\n'
        '[ai]\nbinding = "BRAIN"\n[vars]\nA = "1"\nLIMITS = { max = 3 }\n',
    )
    write(tmp_path / ".dev.vars", '# local secrets\nA="overridden"\nSECRET=s3cr=t\n')
    config = WranglerConfig.load(toml)
    assert config.name == "w" and config.main == (tmp_path / "src" / "entry.py").resolve()
    assert config.account_id == "abc" and config.ai_binding == "BRAIN"
    assert config.vars == {"A": "overridden", "LIMITS": {"max": 3}, "SECRET": "s3cr=t"}


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ('main = "a.py"\n', "name"),
        ('name = "w"\n', "main"),
        ('name = "w"\nmain = "a.py"\n[ai]\nbinding = 3\n', "binding"),
        ('name = "w"\nmain = "a.py"\nvars = 3\n', "vars"),
        ("name = ", "wrangler.toml"),
    ],
)
def test_bad_configs_say_what_is_wrong(tmp_path: Path, text: str, complaint: str) -> None:
    with pytest.raises(ConfigError, match=complaint):
        WranglerConfig.load(write(tmp_path / "wrangler.toml", text))


def test_missing_config_and_bad_dev_vars(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no wrangler config"):
        WranglerConfig.load(tmp_path / "wrangler.toml")
    toml = write(tmp_path / "wrangler.toml", 'name = "w"\nmain = "a.py"\n')
    write(tmp_path / ".dev.vars", "JUSTAKEY\n")
    with pytest.raises(ConfigError, match=r"\.dev\.vars:1"):
        WranglerConfig.load(toml)


def test_credentials_follow_wrangler_names() -> None:
    assert Credentials.from_env({}) == Credentials(api_base_url=DEFAULT_API_BASE_URL)
    env = {
        "CLOUDFLARE_API_BASE_URL": "http://127.0.0.1:8787/client/v4/",
        "CF_API_TOKEN": "old-name",
        "CLOUDFLARE_ACCOUNT_ID": "acc",
    }
    creds = Credentials.from_env(env)
    assert creds.api_base_url == "http://127.0.0.1:8787/client/v4"
    assert creds.auth_headers() == {"Authorization": "Bearer old-name"}
    assert creds.with_account_fallback("from-toml").account_id == "acc"
    assert Credentials().with_account_fallback("from-toml").account_id == "from-toml"
    keyed = Credentials.from_env({"CLOUDFLARE_API_KEY": "k", "CLOUDFLARE_EMAIL": "e@x"})
    assert keyed.auth_headers() == {"X-Auth-Key": "k", "X-Auth-Email": "e@x"}


def test_query_values_are_written_as_js_would() -> None:
    assert _query({"hide_experimental": True, "page": 2, "author": None}) == {
        "hide_experimental": "true",
        "page": "2",
    }
