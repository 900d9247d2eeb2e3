"""Row 7 of issue 27: `/metrics` shows platform-wide per-model request and token counts, so on the
public port it needs the admin token; a tenant's token or no token gets 401/403 without the data."""

from __future__ import annotations

from gateway_harness import KIMI, Harness

ADMIN = "security-metrics-admin"


async def test_metrics_need_the_admin_token(harness: Harness) -> None:
    await harness.services.store.ensure_admin_token(ADMIN)
    await harness.http.post(harness.path(f"/ai/run/{KIMI}"), headers=harness.auth(), json={"prompt": "m"})
    url = f"{harness.url}/metrics"
    attempts = {
        "no token": {},
        "a tenant's token": harness.auth(),
        "a wrong bearer": {"authorization": "Bearer not-the-admin-token"},
    }
    for what, headers in attempts.items():
        r = await harness.http.get(url, headers=headers)
        print(f"tried GET /metrics with {what}: got {r.status_code}")
        assert r.status_code in (401, 403)
        assert "kumo_gateway" not in r.text and KIMI not in r.text
    r = await harness.http.get(url, headers={"authorization": f"Bearer {ADMIN}"})
    print(f"tried GET /metrics with the admin token: got {r.status_code}, {len(r.text)} bytes")
    assert r.status_code == 200
    assert f'model="{KIMI}"' in r.text
    r = await harness.http.get(f"{harness.url}/healthz")
    assert r.status_code == 200  # liveness stays open
