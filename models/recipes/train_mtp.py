"""Train one multi-token-prediction (MTP) layer for a trained nano checkpoint, the target frozen.

    python -m models.recipes.train_mtp --family glm --data DATA_DIR --checkpoint models/glm-5.2-nano \
        --out /tmp/glm-mtp --minutes 12

The layer is DeepSeek-V3's (backend/models/mtp.py): at position j it reads the target's hidden state
h_j after the final norm and the embedding of token j + 1 and predicts token j + 2,

    g_j = block(eh_proj([enorm(embed(x_{j+1})) | hnorm(h_j)]))      logits = lm_head(shared_head.norm(g_j))

with the target's own embedding and lm_head (frozen; `forward_mtp` serves it the same way, the
embedding of position 0 zeroed as there). The block is transformers' own decoder layer of the family
(MLA + MoE; GLM's with its DSA indexer, which gets no gradient and keeps every key below `index_topk`),
started from the target's last layer. Loss: cross-entropy of x_{j+2} on the assistant tokens of the
recipe's own training mixture (the tasks without images: chat, tool calls, arithmetic, reading),
rendered with the checkpoint's template and tokenizer (`models.recipes.render`). `--depths 2` adds the
second chained draft's loss (the layer's own output at j - 1 in place of h_j, as speculation chains it).

On CUDA (the default where there is one) as train.py: bf16 autocast, fused AdamW, padded lengths in
multiples of 64 and no cuDNN attention. The data is rendered and collated once, before the clock starts
(the log gives the time it took); the batches, the trained rows and their labels then live on the
device, the target's hidden states of each batch are kept from its first visit (`--cache-gib`; the
target runs once per batch, not once per epoch), the lm_head runs on the trained rows only, and the
losses stay on the device between log lines: a step waits on nothing. `--minutes` is the wall clock of
the training loop alone, the cosine laid over it after the warmup (train.py's `--steps 0`).

The target is never written: `--out` receives only the layer, in the published layout (its tensors
`model.layers.{num_hidden_layers}.*`, in `mtp.safetensors`, with a config.json giving
`num_nextn_predict_layers: 1`, and a shard index listing them): a draft folder for `--speculative-draft`, which `--install` also merges
into the checkpoint (the tensors listed in its index, the count in its config.json; its shards
untouched).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.nn.attention import sdpa_kernel

from backend.text.tokenizer_files import Family
from models.recipes.build import TEST_ITEMS, TRAIN_ITEMS, build
from models.recipes.render import Example, Renderer
from models.recipes.train import SDPA_BACKENDS, Log, batches, load_model, padded_length, render_all

MTP_FILE = "mtp.safetensors"
IMAGE_TASKS = frozenset({"image-qa", "image-caption"})
DEFAULT_BATCH_TOKENS = {"cuda": 65536, "cpu": 4096}  # by device type; on CUDA the main training's batch
PROBE_STEPS = 20  # the log gives the time per step over these (the GPU waited for once)


def text_config(family: Family, checkpoint: Path) -> dict[str, Any]:
    config = json.loads((checkpoint / "config.json").read_text())
    return dict(config["text_config"]) if family == "kimi" else config


def weight_prefix(family: Family) -> str:
    return "language_model." if family == "kimi" else ""


class Mtp(torch.nn.Module):
    """One MTP layer in transformers' terms: `block` is a one-layer model of the family (its layer 0 the
    decoder block, its final norm the `shared_head.norm`), fed `inputs_embeds`."""

    def __init__(self, family: Family, config: dict[str, Any]) -> None:
        super().__init__()
        import transformers as tf

        one = {**config, "num_hidden_layers": 1, "first_k_dense_replace": 0, "num_nextn_predict_layers": 0}
        one.pop("architectures", None)
        if family == "glm":
            one["mlp_layer_types"] = ["sparse"]
            self.lm: Any = tf.GlmMoeDsaForCausalLM(tf.GlmMoeDsaConfig(**one)).float()
        else:
            self.lm = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**one)).float()
        H, eps = config["hidden_size"], config["rms_norm_eps"]
        self.enorm = torch.nn.RMSNorm(H, eps=eps)
        self.hnorm = torch.nn.RMSNorm(H, eps=eps)
        self.eh_proj = torch.nn.Linear(2 * H, H, bias=False)
        self.lm.model.embed_tokens.requires_grad_(False)  # never read: the target's embedding is
        self.lm.lm_head.requires_grad_(False)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, hidden [B, L, H] → (shared_head.norm(g), g), both [B, L, H]."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        captured: list[torch.Tensor] = []
        hook = self.lm.model.layers[0].register_forward_hook(lambda m, a, out: captured.append(out))
        try:
            normed = self.lm.model(inputs_embeds=x, use_cache=False).last_hidden_state
        finally:
            hook.remove()
        g = captured[0][0] if isinstance(captured[0], tuple) else captured[0]
        return normed, g

    def published(self, family: Family, num_layers: int) -> dict[str, torch.Tensor]:
        """The layer's tensors under the checkpoint's names (bf16; the selection bias float32). The
        embedding and lm_head copies that published checkpoints carry are left out: Kumo reads the
        model's own."""
        with tempfile.TemporaryDirectory() as tmp:
            self.lm.save_pretrained(tmp, safe_serialization=True)
            saved: dict[str, torch.Tensor] = {}
            for f in sorted(Path(tmp).glob("*.safetensors")):
                saved |= load_file(str(f))
        at = f"{weight_prefix(family)}model.layers.{num_layers}."
        out: dict[str, torch.Tensor] = {}
        for name, t in saved.items():
            for block in ("model.layers.0.", "model.blocks.0."):
                if name.startswith(block):
                    out[at + name[len(block) :]] = t
        out[at + "shared_head.norm.weight"] = saved["model.norm.weight"]
        out[at + "enorm.weight"] = self.enorm.weight.detach()
        out[at + "hnorm.weight"] = self.hnorm.weight.detach()
        out[at + "eh_proj.weight"] = self.eh_proj.weight.detach()
        return {
            n: t.to(torch.float32 if n.endswith("e_score_correction_bias") else torch.bfloat16).contiguous()
            for n, t in out.items()
        }

    @torch.no_grad()
    def load_published(self, tensors: dict[str, torch.Tensor], family: Family, num_layers: int) -> None:
        """The inverse of `published`: a draft's tensors back into this module (per-expert tensors
        fused as transformers holds them: gate_up_proj [E, 2I, H], gate first; down_proj [E, H, I])."""
        at = f"{weight_prefix(family)}model.layers.{num_layers}."
        rest = {n[len(at) :]: t.float() for n, t in tensors.items() if n.startswith(at)}
        self.enorm.weight.copy_(rest.pop("enorm.weight"))
        self.hnorm.weight.copy_(rest.pop("hnorm.weight"))
        self.eh_proj.weight.copy_(rest.pop("eh_proj.weight"))
        self.lm.model.norm.weight.copy_(rest.pop("shared_head.norm.weight"))
        num_experts = sum(1 for n in rest if n.endswith(".down_proj.weight") and ".experts." in n)
        expert = "mlp.experts.{}.{}.weight"
        rest["mlp.experts.gate_up_proj"] = torch.stack([
            torch.cat([rest.pop(expert.format(e, "gate_proj")), rest.pop(expert.format(e, "up_proj"))])
            for e in range(num_experts)
        ])  # fmt: skip
        rest["mlp.experts.down_proj"] = torch.stack(
            [rest.pop(expert.format(e, "down_proj")) for e in range(num_experts)]
        )
        self.lm.model.layers[0].load_state_dict(rest, strict=True)


class Target:
    """The frozen checkpoint: hidden states after the final norm, its embedding and lm_head."""

    def __init__(self, family: Family, checkpoint: Path) -> None:
        self.model = load_model(family, checkpoint).eval().requires_grad_(False)
        self.text = self.model.model.language_model if family == "kimi" else self.model.model
        self.lm_head = self.model.lm_head

    @torch.no_grad()
    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.text(input_ids=ids, use_cache=False).last_hidden_state
        return out

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.text.embed_tokens(ids)
        return out

    def last_layer(self) -> torch.nn.Module:
        return self.text.layers[-1]


def shifted(t: torch.Tensor, k: int, fill: int | bool) -> torch.Tensor:
    """t [B, L] moved k positions left, the end filled."""
    return torch.cat([t[:, k:], torch.full_like(t[:, :k], fill)], dim=1)


@dataclass(frozen=True)
class Batch:
    """One length-bucketed batch, collated once before the clock starts and held on the device: a step
    does no host work for its data and waits on nothing."""

    ids: torch.Tensor  # [B, L] right-padded to a multiple of PAD_MULTIPLE (few shapes for the kernels)
    rows: torch.Tensor  # [N] flat positions b * L + j whose x_{j+2} is an assistant token
    labels: torch.Tensor  # [N] those x_{j+2}


def collate(batch: list[Example], pad_id: int, device: torch.device) -> Batch:
    length = padded_length(max(len(ex.token_ids) for ex in batch))
    ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    trained = torch.zeros((len(batch), length), dtype=torch.bool)
    for b, ex in enumerate(batch):
        ids[b, : len(ex.token_ids)] = torch.tensor(ex.token_ids)
        trained[b, : len(ex.token_ids)] = torch.tensor(ex.loss_mask, dtype=torch.bool)
    rows = shifted(trained, 2, False).flatten().nonzero().flatten()
    labels = shifted(ids, 2, 0).flatten()[rows]
    return Batch(ids.to(device), rows.to(device), labels.to(device))


def collate_all(examples: list[Example], pad_id: int, batch_tokens: int, rng: random.Random,
                device: torch.device) -> list[Batch]:  # fmt: skip
    """Every batch of `batches` (seeded order), those without a trained position left out."""
    held = [collate(b, pad_id, device) for b in batches(examples, batch_tokens, rng)]
    return [b for b in held if b.rows.numel()]


def mtp_losses(
    mtp: Mtp, target: Target, batch: Batch, hidden: torch.Tensor, depths: int
) -> list[torch.Tensor]:
    """Per depth d (0-based): the mean cross-entropy of x_{i+2} over its assistant tokens, the layer
    at position i fed embed(x_{i+1}) and, at d = 0, the target's h_i (`hidden` [B, L, H]); after that
    its own output of depth d - 1 at position i - 1, as speculation chains it (draft k runs at position
    p + k on the embedding of draft k - 1 and the layer's output at p + k - 1). The lm_head runs on the
    trained rows only (a few percent of the positions)."""
    ids = batch.ids
    positions = torch.arange(ids.shape[1], device=ids.device)
    embeds = target.embed(shifted(ids, 1, 0)).masked_fill((positions == 0)[None, :, None], 0.0)
    losses, g = [], hidden
    for d in range(depths):
        fed = hidden if d == 0 else torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)
        normed, g = mtp(embeds, fed)
        logits = target.lm_head(normed.flatten(0, 1).index_select(0, batch.rows))  # [N, V]
        losses.append(F.cross_entropy(logits.float(), batch.labels))
    return losses


class HiddenCache:
    """The frozen target's hidden states per batch, kept from the first visit up to `limit_bytes` (the
    target runs once per batch, not once per epoch; held in bf16 on CUDA, where autocast feeds the layer's
    matmuls bf16 anyway, float32 elsewhere). Past the limit a batch's states are recomputed at each visit."""

    def __init__(self, target: Target, limit_bytes: int, dtype: torch.dtype) -> None:
        self.target, self.limit, self.dtype = target, limit_bytes, dtype
        self.held: dict[int, torch.Tensor] = {}
        self.num_bytes = 0

    def __call__(self, index: int, batch: Batch) -> torch.Tensor:
        """[B, L, H] float32 (the layer's norms take float32, as their weights), the same on every visit."""
        hidden = self.held.get(index)
        if hidden is None:
            hidden = self.target.hidden(batch.ids).to(self.dtype)
            size = hidden.numel() * hidden.element_size()
            if self.num_bytes + size <= self.limit:
                self.held[index] = hidden
                self.num_bytes += size
        return hidden.float()


def start_from(mtp: Mtp, target: Target) -> None:
    """The block starts as the target's last decoder layer (same kind: MLA + MoE)."""
    missing = mtp.lm.model.layers[0].load_state_dict(target.last_layer().state_dict(), strict=True)
    assert not missing.missing_keys


def fit(
    mtp: Mtp,
    target: Target,
    held: list[Batch],
    *,
    lr: float,
    warmup: int,
    minutes: float,
    depths: int,
    rng: random.Random,
    log: Callable[[str], None],
    log_every: int,
    max_steps: int = 0,
    cache_bytes: int = 0,
) -> list[float]:
    """AdamW, linear warmup then a cosine over the clock (as train.py's `--steps 0`: `minutes` of wall
    time from here, the data already on the device) or over `max_steps`; bf16 autocast on CUDA. Returns
    the depth-0 loss averaged over each logging window. The losses stay on the device between logs."""
    device = held[0].ids.device
    is_cuda = device.type == "cuda"
    params = [p for p in mtp.parameters() if p.requires_grad]
    decayed = [p for n, p in mtp.named_parameters() if p.requires_grad and p.ndim >= 2 and "norm" not in n]
    rest = [p for p in params if all(p is not q for q in decayed)]
    opt = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        fused=is_cuda,
    )
    budget = minutes * 60
    clock = {"start": time.monotonic()}

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if max_steps:
            frac = (step - warmup) / max(1, max_steps - warmup)
        else:  # the decay spreads over the time left after the warmup
            begin = clock.setdefault("decay_from", time.monotonic())
            frac = (time.monotonic() - begin) / max(1e-9, budget - (begin - clock["start"]))
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    hidden_of = HiddenCache(target, cache_bytes, torch.bfloat16 if is_cuda else torch.float32)
    order = list(range(len(held)))
    windows: list[float] = []
    window: list[torch.Tensor] = []  # [depths] device vectors: no host sync per step
    num_tokens, step = 0, 0
    while True:
        if step % len(order) == 0 and step:
            rng.shuffle(order)
        index = order[step % len(order)]
        step += 1
        batch = held[index]
        num_tokens += batch.ids.numel()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=is_cuda), sdpa_kernel(SDPA_BACKENDS):
            losses = mtp_losses(mtp, target, batch, hidden_of(index, batch), depths)
        torch.stack(losses).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
        window.append(torch.stack(losses).detach())
        elapsed = time.monotonic() - clock["start"]
        done = step >= max_steps if max_steps else elapsed > budget
        if step == PROBE_STEPS and not done:
            float(window[-1][0])  # the GPU caught up: the time is the steps', not their launches'
            log(f"{(time.monotonic() - clock['start']) / step * 1000:.0f} ms per step over the first {step} "
                f"({len(held)} batches, {num_tokens // step} padded tokens a step)")  # fmt: skip
        if step % log_every == 0 or done:
            means = torch.stack(window).mean(dim=0).tolist()
            windows.append(means[0])
            window = []
            log(f"step {step} loss {' '.join(f'{m:.4f}' for m in means)} lr {schedule.get_last_lr()[0]:.2e} "
                f"grad-norm {float(norm):.2f}")  # fmt: skip
        if done:
            elapsed = time.monotonic() - clock["start"]
            log(f"stopped at step {step} ({'steps' if max_steps else f'the {minutes}-minute limit'}): "
                f"{elapsed / step * 1000:.0f} ms per step, {num_tokens / elapsed:,.0f} padded tokens/s, "
                f"{step / len(held):.1f} epochs of {len(held)} batches, the target's states of "
                f"{len(hidden_of.held)} held ({hidden_of.num_bytes / 2**30:.2f} GiB)")  # fmt: skip
            return windows


def write_draft(family: Family, checkpoint: Path, mtp: Mtp, out: Path) -> None:
    """The layer as a draft folder: mtp.safetensors + config.json (the checkpoint's, with the count)."""
    config = json.loads((checkpoint / "config.json").read_text())
    text = config["text_config"] if family == "kimi" else config
    text["num_nextn_predict_layers"] = 1
    tensors = mtp.published(family, int(text["num_hidden_layers"]))
    save_file(tensors, str(out / MTP_FILE), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": {n: MTP_FILE for n in sorted(tensors)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))


def install(draft: Path, checkpoint: Path) -> None:
    """Merge a draft folder into the checkpoint: its file copied in and listed in the index, the count
    in config.json. The checkpoint's own shards are not touched."""
    shutil.copy(draft / MTP_FILE, checkpoint / MTP_FILE)
    tensors = load_file(str(draft / MTP_FILE))
    index_path = checkpoint / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    earlier = [n for n, f in index["weight_map"].items() if f == MTP_FILE]
    for n in earlier:
        del index["weight_map"][n]
    index["weight_map"].update({n: MTP_FILE for n in tensors})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index["metadata"]["total_size"] = sum(
        t.numel() * t.element_size() for t in load_all(checkpoint, index["weight_map"]).values()
    )
    index_path.write_text(json.dumps(index, indent=2))
    config = json.loads((checkpoint / "config.json").read_text())
    (config.get("text_config") or config)["num_nextn_predict_layers"] = 1
    (checkpoint / "config.json").write_text(json.dumps(config, indent=2))


def load_all(folder: Path, weight_map: dict[str, str]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map.values())):
        out |= load_file(str(folder / file))
    return out


def train_mtp(
    family: Family,
    data: Path,
    checkpoint: Path,
    out: Path,
    *,
    minutes: float = 12.0,
    max_steps: int = 0,
    batch_tokens: int = 0,
    lr: float = 1e-3,
    warmup: int = 20,
    depths: int = 2,
    max_len: int = 1024,
    max_items: int | None = 20_000,
    seed: int = 0,
    workers: int = 1,
    log_every: int = 25,
    init: Path | None = None,
    device: str = "cuda" if torch.cuda.is_available() else "cpu",
    cache_gib: float = 16.0,
) -> list[float]:
    """Train the layer (from the target's last layer, or from the draft folder `init`) and write the
    draft folder `out` (with its `train.log`); returns the logged depth-0 losses. `batch_tokens` 0:
    DEFAULT_BATCH_TOKENS of the device. `cache_gib`: the target's hidden states kept (HiddenCache)."""
    import transformers

    dev = torch.device(device)
    batch_tokens = batch_tokens or DEFAULT_BATCH_TOKENS.get(dev.type, 4096)

    settings = dict(family=family, data=str(data), checkpoint=str(checkpoint), out=str(out), minutes=minutes,
                    max_steps=max_steps, batch_tokens=batch_tokens, lr=lr, warmup=warmup, depths=depths,
                    max_len=max_len, max_items=max_items, seed=seed, init=str(init) if init else None, device=device,
                    cache_gib=cache_gib)  # fmt: skip
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    random.seed(seed)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    out.mkdir(parents=True)
    with (out / "train.log").open("w") as log_file:
        log = Log(log_file)
        log(
            f"train_mtp {json.dumps(settings)}; torch {torch.__version__}, transformers {transformers.__version__}"
        )
        if not (data / "train.jsonl").exists():
            log(
                f"building data into {data}: {build(data, family=family, train_items=TRAIN_ITEMS, test_items=TEST_ITEMS)}"
            )
        prep = time.monotonic()
        with (data / "train.jsonl").open() as f:
            items = [it for line in f if (it := json.loads(line)).get("task") not in IMAGE_TASKS]
        if max_items is not None and max_items < len(items):
            items = rng.sample(items, max_items)
        log(f"{len(items)} text items read in {time.monotonic() - prep:.1f} s")
        rendering = time.monotonic()
        examples, dropped = render_all(checkpoint, items, max_len, workers)
        log(f"{len(items)} text items → {len(examples)} sequences ({dropped} over {max_len} dropped), "
            f"{sum(sum(ex.loss_mask) for ex in examples)} assistant tokens; rendered in "
            f"{time.monotonic() - rendering:.1f} s ({workers} workers)")  # fmt: skip
        target = Target(family, checkpoint)
        mtp = Mtp(family, text_config(family, checkpoint))
        if init is None:
            start_from(mtp, target)
        else:
            mtp.load_published(
                load_file(str(init / MTP_FILE)),
                family,
                int(text_config(family, checkpoint)["num_hidden_layers"]),
            )
            log(f"continuing from {init}")
        target.model.to(dev)
        mtp.to(dev).train()
        before = {n: t.clone() for n, t in target.model.state_dict().items()}
        held = collate_all(examples, Renderer(checkpoint).eos_id, batch_tokens, rng, dev)
        log(f"{len(held)} batches of ≤ {batch_tokens} padded tokens on {dev}; data prep took "
            f"{time.monotonic() - prep:.1f} s, the {minutes}-minute clock starts now")  # fmt: skip
        losses = fit(mtp, target, held, lr=lr, warmup=warmup, minutes=minutes, depths=depths, rng=rng, log=log,
                     log_every=log_every, max_steps=max_steps, cache_bytes=int(cache_gib * 2**30))  # fmt: skip
        after = target.model.state_dict()
        assert all(torch.equal(before[n], after[n]) for n in before), "the target changed"
        write_draft(family, checkpoint, mtp.cpu().eval(), out)
        log(f"saved {out / MTP_FILE}")
    return losses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=["kimi", "glm"], required=True)
    p.add_argument(
        "--data", type=Path, required=True, help="built data (built here if it has no train.jsonl)"
    )
    p.add_argument("--checkpoint", type=Path, required=True, help="the trained target folder (read only)")
    p.add_argument("--out", type=Path, required=True, help="the draft folder to create")
    p.add_argument("--minutes", type=float, default=12.0, help="wall time of the training loop")
    p.add_argument("--steps", type=int, default=0, help="a step count instead of the clock")
    p.add_argument("--batch-tokens", type=int, default=0,
                   help=f"padded tokens a batch (0: by device type, {DEFAULT_BATCH_TOKENS})")  # fmt: skip
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--depths", type=int, default=2, help="chained draft depths trained (1: x_{j+2} only)")
    p.add_argument("--max-items", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="rendering processes")
    p.add_argument("--init", type=Path, default=None, help="continue from this draft folder's layer")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cache-gib", type=float, default=16.0,
                   help="the target's hidden states kept per batch up to this (0: recomputed each step)")  # fmt: skip
    p.add_argument("--install", action="store_true", help="merge the trained layer into --checkpoint")
    a = p.parse_args(argv)
    train_mtp(a.family, a.data, a.checkpoint, a.out, minutes=a.minutes, max_steps=a.steps,
              batch_tokens=a.batch_tokens, lr=a.lr, warmup=a.warmup, depths=a.depths,
              max_items=a.max_items or None, seed=a.seed, workers=a.workers, init=a.init, device=a.device,
              cache_gib=a.cache_gib)  # fmt: skip
    if a.install:
        install(a.out, a.checkpoint)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
