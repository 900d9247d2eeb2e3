"""`kumo bench engine scenario NAME --tp N`: the scenario on a real group of N ranks, one process per
device (NCCL on CUDA, gloo on the CPU), as `kumo backend --tp N` runs (backend/engine/ranks.py).

The command is rank 0. It starts ranks 1..N−1 as the same command with `--tp-rank r --tp-port P`
(each killed by the kernel if rank 0 dies), and every rank then builds the same sides: rank r's slice
of each random model (seeded by rank) and the same engines over it, with their FP8 scales calibrated
together (the calibration's forward runs the collectives on every rank). Rank 0 then measures the
scenario as on one device; its engines' steps reach the others through `SideChannel`, which tags each
step with the side it belongs to, since the two sides are two engines (two models, two pools):

    rank 0 (Engine.step → ModelRunner.run)           rank r > 0 (`follow`)
    SideChannel("A").send(StepInputs)  ── bcast ──▶  (key, inputs) → engines[key].runner.forward_step
    forward + tag-flag all-reduce      ◀─────────▶  forward + tag-flag all-reduce
    ... when done: send None            ── bcast ──▶  stop

Pure-decode steps replay CUDA graphs on every rank, the collectives captured in them, as in the
backend (backend/engine/ranks.py); `--no-cuda-graphs` runs every step eagerly.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from backend.engine.ranks import KeepAlive, StepChannel, StepInputs

STARTUP_TIMEOUT_S = 900.0  # the ranks meet once each has imported torch and found its device
STEP_TIMEOUT_S = 900.0  # a collective that waits longer fails the run (a rank died or hung)


class SideChannel(StepChannel):
    """Rank 0's channel for the engine of side `key`: each step goes out as (key, inputs)."""

    num_sent = 0  # steps sent by every SideChannel of this process (the followers run as many)

    def __init__(self, key: str, rank: int, world_size: int, device: torch.device) -> None:
        super().__init__(rank, world_size, device)
        self.key = key

    def send(self, inputs: StepInputs | None) -> None:
        if inputs is None:
            return self.stop()
        SideChannel.num_sent += 1
        self._broadcast([(self.key, inputs)])  # type: ignore[list-item]

    def stop(self) -> None:
        """Tell the other ranks there are no more steps."""
        self._broadcast([None])


def follow(engines: dict[str, Any], channel: StepChannel) -> int:
    """Ranks > 0: run rank 0's steps, each on the engine of its side, until it says stop; the
    number of steps run (printed, so rank 0's caller can compare it with `SideChannel.num_sent`)."""
    num_steps = 0
    while True:
        box: list[Any] = [None]
        channel._broadcast(box)
        if box[0] is None:
            print(f"kumo bench engine scenario: rank {channel.rank} followed {num_steps} steps", flush=True)
            return num_steps
        if isinstance(box[0], KeepAlive):  # an idle rank 0 (backend/engine/ranks.py)
            continue
        key, inputs = box[0]
        engines[key].runner.forward_step(inputs)
        num_steps += 1


def rank_device(device: str, rank: int) -> torch.device:
    """cuda:rank with `--device cuda`, else the CPU (every rank on it)."""
    return torch.device("cuda", rank) if torch.device(device).type == "cuda" else torch.device("cpu")


def store(rank: int, world_size: int, port: int = 0) -> dist.TCPStore:  # type: ignore[name-defined]
    """The group's store on loopback: rank 0 hosts it on a port the kernel picks and binds now
    (`.port`: what the followers are given; backend.engine.ranks.rank_store says why), the others
    connect to `port`."""
    return dist.TCPStore(  # type: ignore[attr-defined]  # torch re-exports it without __all__
        "127.0.0.1",
        port,
        world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
        wait_for_workers=False,
    )


def join(rank: int, world_size: int, group_store: dist.Store, device: torch.device) -> None:  # type: ignore[name-defined]
    """Join the group of `world_size` ranks through `group_store` (`store`)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=group_store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=STEP_TIMEOUT_S),
    )


def start_followers(argv: list[str], world_size: int, port: int) -> list[subprocess.Popen[bytes]]:
    """Ranks 1..N−1: this command again (`python -m benchmarks.cli engine scenario ARGV`) with its
    rank and the store's port, each killed by the kernel when this process dies."""
    from schemas.child_process import die_with_parent

    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.cli",
                "engine",
                "scenario",
                *argv,
                "--tp-rank",
                str(rank),
                "--tp-port",
                str(port),
            ],
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )  # fmt: skip
        for rank in range(1, world_size)
    ]


def wait_followers(processes: list[subprocess.Popen[bytes]], timeout_s: float = 60.0) -> list[int]:
    """Their exit codes (a follower that does not leave within `timeout_s` is killed: -9)."""
    codes = []
    for p in processes:
        try:
            codes.append(p.wait(timeout_s))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


def stop_channel(rank: int, world_size: int, device: torch.device) -> SideChannel:
    """The channel rank 0 says stop on, and ranks > 0 receive every step on (`follow`)."""
    return SideChannel("", rank, world_size, device)
