"""A real 2-rank run (torch.distributed over gloo, on the CPU) gives the 1-rank logits.

Each rank loads only its slices (attention heads, dense-MLP columns, an expert range) and the
row-parallel layers and the MoE all-reduce; the logits must match the single-rank model's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from backend.models.loader import load_model
from tests.backend.conformance import prompts
from tests.backend.paged_driver import PagedDriver
from tests.backend.tiny_checkpoints import make_tiny

WORLD_SIZE = 2


def _rank_main(rank: int, path: str, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        loaded = load_model(path, dtype=torch.float32, rank=rank, world_size=WORLD_SIZE)
        _, logits = PagedDriver(loaded.model).prefill(prompts(loaded.config.vocab_size, (17, 33)), 16)
        torch.save(logits, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_two_ranks_compute_the_single_rank_logits(arch: str, tmp_path: Path) -> None:
    path = make_tiny(arch, tmp_path / arch)
    loaded = load_model(path, dtype=torch.float32)
    _, expected = PagedDriver(loaded.model).prefill(prompts(loaded.config.vocab_size, (17, 33)), 16)
    mp.start_processes(
        _rank_main,
        args=(str(path), str(tmp_path / "rdzv"), str(tmp_path)),
        nprocs=WORLD_SIZE,
        start_method="fork",
    )
    for rank in range(WORLD_SIZE):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
