"""The MTP stage of the recipe (models/recipes/train_mtp.py) at micro scale on the CPU: it lowers the
MTP loss, leaves the target bit-identical, installs into the checkpoint without changing what loads
without speculation, and Kumo's `forward_mtp` gives the trained layer's logits (transformers' blocks,
as trained) on the saved tensors."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from backend.models.loader import load_model
from models.recipes.build import build, item
from models.recipes.render import Renderer
from models.recipes.train import train
from models.recipes.train_mtp import MTP_FILE, Mtp, Target, install, shifted, text_config, train_mtp
from models.recipes.world import make_world
from tests.backend.paged_driver import PagedDriver, Seq

pytestmark = pytest.mark.slow  # micro trainings: `make test-fast` leaves them out

MAX_ABS_DIFF = 1e-4


def digests(folder: Path) -> dict[str, str]:
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir()) if f.is_file()
    }


@pytest.fixture(scope="module", params=["glm", "kimi"])
def staged(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A micro checkpoint trained by the recipe, then the MTP stage on it."""
    family = request.param
    root = tmp_path_factory.mktemp(f"mtp-{family}")
    build(root / "data", family=family, train_items=140, test_items=1)
    train(family, root / "data", root / "ckpt", size="micro", steps=24, batch_tokens=1024, lr=4e-3, warmup=2,
          max_len=400, log_every=4, device="cpu", max_items=200, workers=1)  # fmt: skip
    if family == "glm":  # as the nano model has it: the DSA top-k keeps every key of these sequences
        config = json.loads((root / "ckpt" / "config.json").read_text())
        (root / "ckpt" / "config.json").write_text(json.dumps(config | {"index_topk": 2048}, indent=2))
    before = digests(root / "ckpt")
    losses = train_mtp(family, root / "data", root / "ckpt", root / "draft", max_steps=40, batch_tokens=1024,
                       lr=3e-3, warmup=2, max_len=400, max_items=200, log_every=5)  # fmt: skip
    return {"family": family, "root": root, "losses": losses, "before": before}


def test_the_stage_lowers_the_mtp_loss(staged: dict[str, object]) -> None:
    losses = staged["losses"]
    assert isinstance(losses, list) and len(losses) == 8
    assert losses[-1] < 0.85 * losses[0], losses  # the first window starts from an untrained layer


def test_the_stage_leaves_the_target_bit_identical(staged: dict[str, object]) -> None:
    root = staged["root"]
    assert isinstance(root, Path)
    assert digests(root / "ckpt") == staged["before"]


def test_installed_layer_loads_only_when_asked(staged: dict[str, object]) -> None:
    family, root = staged["family"], staged["root"]
    assert isinstance(root, Path)
    installed = root / "installed"
    shutil.copytree(root / "ckpt", installed)
    install(root / "draft", installed)
    before, after = staged["before"], digests(installed)
    assert isinstance(before, dict)
    changed = {n for n in after if before.get(n) != after[n]}
    assert changed == {MTP_FILE, "config.json", "model.safetensors.index.json"}
    config = json.loads((installed / "config.json").read_text())
    assert (config.get("text_config") or config)["num_nextn_predict_layers"] == 1
    plain = load_model(root / "ckpt", dtype=torch.float32).model.state_dict()
    same = load_model(installed, dtype=torch.float32).model.state_dict()  # no --speculative
    assert plain.keys() == same.keys()
    assert all(torch.equal(plain[n], same[n]) for n in plain)
    with_mtp = load_model(installed, dtype=torch.float32, num_mtp_layers=1).model
    assert with_mtp.num_mtp_layers == 1
    n = int(text_config(family, root / "ckpt")["num_hidden_layers"])  # type: ignore[arg-type]
    assert all(f"model.layers.{n}." in name for name in load_file(str(installed / MTP_FILE)))


def test_held_target_states_train_as_recomputed(staged: dict[str, object], tmp_path: Path) -> None:
    """The target's hidden states kept from each batch's first visit (`--cache-gib`, HiddenCache) give
    the very losses of recomputing them at every step, over more than one pass of the batches."""
    family, root = staged["family"], staged["root"]
    assert isinstance(root, Path) and family in ("glm", "kimi")
    runs = {
        gib: train_mtp(family, root / "data", root / "ckpt", tmp_path / f"gib-{gib}", max_steps=7, batch_tokens=512,
                       lr=3e-3, warmup=2, max_len=400, max_items=6, log_every=1, device="cpu", cache_gib=gib)
        for gib in (0.0, 1.0)
    }  # fmt: skip
    assert len(runs[1.0]) == 7 and runs[1.0] == runs[0.0]
    for gib, num_held in ((0.0, 0), (1.0, None)):
        stop = re.search(r"([\d.]+) epochs of (\d+) batches, the target's states of (\d+) held",
                         (tmp_path / f"gib-{gib}" / "train.log").read_text())  # fmt: skip
        assert stop is not None
        assert float(stop[1]) > 1.0  # batches visited again: read back from the cache when on
        assert int(stop[3]) == (int(stop[2]) if num_held is None else num_held)


@torch.no_grad()
def test_kumo_serves_the_layer_as_trained(staged: dict[str, object]) -> None:
    """Depth 0 over a rendered tool-call prompt: Kumo's paged `forward_mtp` on the draft folder, and
    the training module (transformers' blocks) holding the same bf16 tensors, read back from it."""
    family, root = staged["family"], staged["root"]
    assert isinstance(root, Path) and family in ("glm", "kimi")
    ckpt, draft = root / "ckpt", root / "draft"
    ids = Renderer(ckpt).examples(item("tool-call", 1, make_world(0)))[0].token_ids
    model = load_model(ckpt, dtype=torch.float32, num_mtp_layers=1, draft=draft).model
    driver = PagedDriver(model, num_pages=len(ids) // 8 + 8)
    target_batch = driver.batch([Seq(tokens=list(ids))], [len(ids)])
    _, h = model.forward_spec(target_batch)
    draft_batch = driver.batch([Seq(tokens=[*ids[1:], 0])], [len(ids)])
    ours, _ = model.forward_mtp(draft_batch, h, 0)
    assert not target_batch.tag_mismatch.any() and not draft_batch.tag_mismatch.any()
    target = Target(family, ckpt)
    mtp = Mtp(family, text_config(family, ckpt)).eval()
    tensors = load_file(str(draft / MTP_FILE))
    num_layers = int(text_config(family, ckpt)["num_hidden_layers"])
    mtp.load_published(tensors, family, num_layers)
    assert all(torch.equal(t, mtp.published(family, num_layers)[n]) for n, t in tensors.items())  # round trip
    x = torch.tensor([ids])
    embeds = target.embed(shifted(x, 1, 0))
    embeds[:, 0] = 0.0  # position 0, as forward_mtp
    normed, _ = mtp(embeds, target.hidden(x))
    theirs = target.lm_head(normed)[0]
    diff = (ours - theirs).abs().amax(dim=-1)[:-1]  # the last row's next token is a stand-in
    assert diff.max().item() <= MAX_ABS_DIFF, (
        len(ids),
        (diff > MAX_ABS_DIFF).nonzero().flatten()[:5].tolist(),
    )
