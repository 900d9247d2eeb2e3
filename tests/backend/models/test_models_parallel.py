"""Real 2- and 4-rank runs (torch.distributed over gloo, on the CPU) give the 1-rank logits.

Each rank loads only its slices (attention heads, dense-MLP columns, its experts or slices of them,
its vocabulary rows, with a vocabulary that does not divide over the ranks) and runs the same
engine steps: chunked prefill of two prompts, then decode steps (Kimi K2.5 with an image in the
first prompt, its vision tower replicated). Every step's logits must equal the single-rank model's
within 1e-5 in float32, for tensor + expert parallelism and for MLA decode context parallelism.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image

from backend.engine.forward_batch import ImageEmbeds
from backend.models.image_processor import process_image
from backend.models.loader import load_model
from tests.backend.conformance import prompts
from tests.backend.paged_driver import PagedDriver, Seq
from tests.backend.tiny_checkpoints import make_tiny

VOCAB = 253  # prime: the vocab-parallel ranges are uneven at 2 and 4 ranks
DECODE_STEPS = 3
MLA = ("deepseek_v3", "glm_moe_dsa", "kimi_k25")
# (ranks, [(ep, dcp), ...]) run in one process group; ep 0 = tp (whole experts per rank)
LAYOUTS: dict[int, list[tuple[int, int]]] = {2: [(0, 1), (1, 1), (0, 2)], 4: [(0, 1), (2, 2), (0, 4)]}


def _image_step(path: Path, tokens: list[int], rows: list[int]) -> ImageEmbeds:
    """The replicated vision tower's embeddings for `rows` of the first prefill chunk."""
    from backend.models.image_encoder import VisionEncoder

    vision = VisionEncoder.from_checkpoint(path, pad_token_id=1, dtype=torch.float32)
    assert vision is not None
    buf = io.BytesIO()
    pixels = np.random.default_rng(5).integers(0, 256, (56, 56, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format="PNG")
    image = process_image(buf.getvalue())
    embeds = vision._tower(image.patches, [(image.grid_h, image.grid_w)])
    assert embeds.shape[0] == len(rows)
    return ImageEmbeds(token_indices=torch.tensor(rows), embeds=embeds)


@torch.no_grad()
def run_steps(model: torch.nn.Module, path: Path, arch: str, dcp: int) -> list[torch.Tensor]:
    """Two chunked-prefill steps of two prompts, then decode steps; every step's logits [T, V]."""
    a, b = prompts(VOCAB, (23, 33))
    seqs = [Seq(tokens=a), Seq(tokens=b)]
    driver = PagedDriver(model, dcp=dcp)
    out = []
    first = driver.batch(seqs, [20, 16])
    if arch == "kimi_k25":  # image rows 4..7 of the first prompt, in the first chunk
        first.image_embeds = _image_step(path, a, [4, 5, 6, 7])
    out.append(model(first))
    for s, n in zip(seqs, [20, 16], strict=True):
        s.num_cached += n
    out.append(torch.cat(driver.run(seqs, [3, 17])))
    for step in range(DECODE_STEPS):
        for s in seqs:
            s.tokens.append(5 + step)
        out.append(torch.cat(driver.run(seqs, [1, 1])))
    assert not driver.last_mismatch.any()
    return out


def _assert_split(model: torch.nn.Module, rank: int, world: int, ep: int) -> None:
    """This rank holds its vocabulary rows and its experts (or its slice of each), not the whole."""
    chunk = -(-VOCAB // world)
    rows = min(chunk, VOCAB - rank * chunk)
    assert model.model.embed_tokens.weight.shape[0] == model.lm_head.weight.shape[0] == rows
    experts = model.model.layers[1].mlp.experts
    assert experts.e1 - experts.e0 == 8 // ep and experts.intermediate == 32 * ep // world


def _rank_main(rank: int, world: int, arch: str, path: str, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for ep, dcp in LAYOUTS[world]:
            if dcp > 1 and arch not in MLA:
                continue
            loaded = load_model(path, dtype=torch.float32, rank=rank, world_size=world, ep=ep, dcp=dcp)
            _assert_split(loaded.model, rank, world, ep or world)
            logits = run_steps(loaded.model, Path(path), arch, dcp)
            torch.save(logits, Path(out_dir) / f"ep{ep}-dcp{dcp}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# GLM-5 twice: index_topk 8 selects at every step; at 32 the first step (pages of 32 tokens under DCP
# 2, two of 16 on one rank) runs dense MLA without the indexer, the later ones select
@pytest.fixture(
    scope="module",
    params=[("deepseek_v3", 0), ("glm_moe_dsa", 0), ("glm_moe_dsa", 32), ("glm4_moe", 0), ("kimi_k25", 0)],
    ids=["deepseek_v3", "glm_moe_dsa", "glm_moe_dsa-topk32", "glm4_moe", "kimi_k25"],
)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    arch, index_topk = request.param
    overrides = {"index_topk": index_topk} if index_topk else {}
    return arch, make_tiny(arch, tmp_path_factory.mktemp(arch) / "ckpt", vocab_size=VOCAB, **overrides)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_compute_the_single_rank_logits(tiny: tuple[str, Path], world: int, tmp_path: Path) -> None:
    arch, path = tiny
    expected = run_steps(load_model(path, dtype=torch.float32).model, path, arch, 1)
    mp.start_processes(
        _rank_main,
        args=(world, arch, str(path), str(tmp_path / "rdzv"), str(tmp_path)),
        nprocs=world,
        start_method="fork",
    )
    for ep, dcp in LAYOUTS[world]:
        if dcp > 1 and arch not in MLA:
            continue
        for rank in range(world):
            got = torch.load(tmp_path / f"ep{ep}-dcp{dcp}-rank{rank}.pt")
            assert len(got) == len(expected)
            for g, e in zip(got, expected, strict=True):
                assert g.shape == e.shape == (e.shape[0], VOCAB)
                torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=f"ep {ep} dcp {dcp} rank {rank}")


def test_layouts_that_do_not_divide_are_refused(tmp_path: Path) -> None:
    from backend.errors import CheckpointError
    from backend.models.layers.linear import Shard
    from backend.models.layers.parallel import Parallel, vocab_range

    assert [vocab_range(Shard(r, 4), 253) for r in range(4)] == [(0, 64), (64, 128), (128, 192), (192, 253)]
    assert [vocab_range(Shard(r, 4), 5) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert Parallel(rank=5, tp=8, ep=2).expert_shard == Shard(1, 2)
    assert Parallel(rank=5, tp=8, ep=2).expert_width_shard == Shard(1, 4)
    for bad in ({"ep": 3}, {"dcp": 3}, {"rank": 4}):
        with pytest.raises(CheckpointError):
            Parallel(**{"rank": 0, "tp": 4} | bad)
    with pytest.raises(CheckpointError, match="MLA"):  # GQA has no latent cache to shard
        load_model(make_tiny("glm4_moe", tmp_path / "glm4"), dtype=torch.float32, rank=0, world_size=2, dcp=2)
