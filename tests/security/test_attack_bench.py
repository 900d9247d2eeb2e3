"""`kumo bench attack`'s bounded subset against the fake-backed gateway: each attack runs, prints
what it tried and got, and holds; a victim request of another tenant succeeds during each.

`image_bomb` needs a real Kimi backend (its cap is the backend's; see
`test_image_cost.py`)."""

from __future__ import annotations

import os

from gateway_harness import GLM, KIMI, Harness, _tenant

from benchmarks.attack import ATTACKS, Outcome, Target, goal_met, run
from benchmarks.cli import main as bench_main

CI_SUBSET = [
    "cross_tenant", "body_size", "nesting", "ssrf", "poll_flood", "batch_flood", "grammar_bomb",
    "vanishing_streams", "metrics", "big_header", "slowloris",
]  # fmt: skip


async def test_the_bounded_attacks_hold_and_the_victim_is_served(harness: Harness) -> None:
    victim_account, victim_token = await _tenant(harness.services, "attack-victim", "paid")
    target = Target(
        url=harness.url, account=harness.account, token=harness.token,
        victim_account=victim_account, victim_token=victim_token, model=GLM, vision_model=KIMI, quick=True,
    )  # fmt: skip
    # the gateway runs in this process: its RSS is recorded (not bounded: this process holds pytest too)
    unloaded, outcomes = await run(target, CI_SUBSET, {"gateway": os.getpid()})
    assert unloaded is not None
    assert [o.name for o in outcomes] == CI_SUBSET
    for o in outcomes:
        assert o.held, o
        assert o.victim_s is not None, o  # the victim's request succeeded during the attack
        assert o.seconds < 60, o  # bounded
        assert o.peak_rss_mb is not None and o.peak_rss_mb["gateway"] > 0, o


def test_the_command_names_its_attacks() -> None:
    assert set(CI_SUBSET) <= set(ATTACKS)
    try:
        bench_main(["attack", "--url", "http://127.0.0.1:9", "--account", "a", "--token", "t",
                    "--victim-account", "v", "--victim-token", "vt", "--only", "no_such_attack"])  # fmt: skip
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("an unknown attack must be a usage error")


def test_the_goal_bounds_the_victim_ratio_and_each_process_rss() -> None:
    def outcome(victim_s: float | None, **rss: float) -> Outcome:
        return Outcome("a", "tried", "got", True, 1.0, victim_s, rss or None)

    assert goal_met(outcome(0.2, gateway=511, glm=4095), unloaded=0.1)
    assert not goal_met(outcome(0.21, gateway=100), unloaded=0.1)  # past 2x the unloaded latency
    assert not goal_met(outcome(None), unloaded=0.1)  # the victim failed
    assert not goal_met(outcome(0.1, gateway=512), unloaded=0.1)  # the gateway's 512 MB
    assert not goal_met(outcome(0.1, gateway=100, glm=4096), unloaded=0.1)  # a backend's 4 GB
    assert not goal_met(outcome(0.1, gateway=float("nan")), unloaded=0.1)  # unreadable is not under
    assert not goal_met(Outcome("a", "tried", "got", False, 1.0, 0.1), unloaded=0.1)  # did not hold
