"""MoonViT, the vision tower of Kimi K2.5 / K2.6, and its projector into the text model.

Weights load in the original checkpoint layout (`vision_tower.encoder.blocks.{i}.wqkv` fused, the
rotary pairs interleaved), which is what real K2.5 checkpoints ship and what transformers writes back
on `save_pretrained`. Images only (one frame each): the temporal embedding row of a single frame is
zero, so it is not applied.

Shape letters: N = patches of all images, D = vision hidden, Hh = heads, d = head dim,
M = merged tokens (N / 4 for the 2×2 merge), H = text hidden.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backend.errors import CheckpointError


@dataclass(frozen=True, slots=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_hidden_layers: int
    patch_size: int
    pos_emb_height: int
    pos_emb_width: int
    merge_kernel_size: tuple[int, int]
    rope_theta: float
    hidden_act: str
    projection_hidden_size: int
    projection_layer_norm_eps: float
    text_hidden_size: int

    @classmethod
    def from_config(cls, raw: dict[str, Any], text_hidden_size: int) -> VisionConfig:
        """Read the `vision_config` block of a Kimi K2.5 config.json (and the projector keys)."""
        vc = raw.get("vision_config") or {}
        rope = vc.get("rope_parameters") or {}
        merge = vc.get("merge_kernel_size", (2, 2))
        return cls(
            hidden_size=vc.get("hidden_size", 1152),
            intermediate_size=vc.get("intermediate_size", 4304),
            num_attention_heads=vc.get("num_attention_heads", 16),
            num_hidden_layers=vc.get("num_hidden_layers", 27),
            patch_size=vc.get("patch_size", 14),
            pos_emb_height=vc.get("pos_emb_height", vc.get("init_pos_emb_height", 64)),
            pos_emb_width=vc.get("pos_emb_width", vc.get("init_pos_emb_width", 64)),
            merge_kernel_size=(int(merge[0]), int(merge[1])),
            rope_theta=float(rope.get("rope_theta", vc.get("rope_theta", 10000.0))),
            hidden_act=vc.get("hidden_act", "gelu_pytorch_tanh"),
            projection_hidden_size=raw.get("projection_hidden_size") or vc.get("hidden_size", 1152),
            projection_layer_norm_eps=raw.get("projection_layer_norm_eps", 1e-5),
            text_hidden_size=text_hidden_size,
        )

    @property
    def tokens_per_merge(self) -> int:
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]


def _act(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise CheckpointError(f"unsupported vision activation {name!r}")


def _rope_angles(grid_hw: list[tuple[int, int]], head_dim: int, theta: float) -> torch.Tensor:
    """`[N, d/2]` rotation angle of each interleaved pair: pair 2j turns with the column (w) and
    pair 2j+1 with the row (h), both at frequency theta^(-4j/d)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 4, dtype=torch.float32)[: head_dim // 4] / head_dim))
    parts = []
    for h, w in grid_hw:
        rows = torch.arange(h, dtype=torch.float32).repeat_interleave(w)  # [h*w] raster order
        cols = torch.arange(w, dtype=torch.float32).repeat(h)
        angles = torch.stack([torch.outer(cols, freqs), torch.outer(rows, freqs)], dim=-1)  # [h*w, d/4, 2]
        parts.append(angles.flatten(1))
    return torch.cat(parts)


def _apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x `[N, Hh, d]` with pairs (2i, 2i+1) rotated by angles `[N, d/2]`."""
    xf = torch.unflatten(x.float(), -1, (-1, 2))  # [N, Hh, d/2, 2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    a, b = xf[..., 0], xf[..., 1]
    out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        D = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.norm0 = nn.LayerNorm(D, eps=1e-5)
        self.norm1 = nn.LayerNorm(D, eps=1e-5)
        self.wqkv = nn.Linear(D, 3 * D)
        self.wo = nn.Linear(D, D)
        self.fc0 = nn.Linear(D, cfg.intermediate_size)
        self.fc1 = nn.Linear(cfg.intermediate_size, D)
        self.act = _act(cfg.hidden_act)

    def forward(self, x: torch.Tensor, angles: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        N, D = x.shape
        q, k, v = self.wqkv(self.norm0(x)).view(N, 3, self.num_heads, -1).unbind(1)  # each [N, Hh, d]
        q, k = _apply_rope(q, angles), _apply_rope(k, angles)
        out = torch.empty_like(q)
        for start, end in zip(
            cu_seqlens[:-1], cu_seqlens[1:], strict=True
        ):  # each image attends to itself only
            qi, ki, vi = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [Hh, n, d]
            out[start:end] = F.scaled_dot_product_attention(qi, ki, vi).transpose(0, 1)
        x = x + self.wo(out.reshape(N, D))
        mlp: torch.Tensor = self.fc1(self.act(self.fc0(self.norm1(x))))  # nn.Linear's call is untyped
        return x + mlp


class MoonViT(nn.Module):
    """Vision tower + 2×2 patch merger + projector: pixel patches → text-space embeddings."""

    def __init__(self, cfg: VisionConfig, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = cfg
        D, P = cfg.hidden_size, cfg.patch_size
        self.patch_proj = nn.Conv2d(3, D, kernel_size=P, stride=P)
        self.pos_emb = nn.Parameter(torch.zeros(cfg.pos_emb_height, cfg.pos_emb_width, D))
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(D, eps=1e-5)
        self.pre_norm = nn.LayerNorm(cfg.projection_hidden_size, eps=cfg.projection_layer_norm_eps)
        merged = D * cfg.tokens_per_merge
        self.proj_in = nn.Linear(merged, merged)
        self.proj_out = nn.Linear(merged, cfg.text_hidden_size)
        self.to(dtype)

    def num_tokens(self, grid_h: int, grid_w: int) -> int:
        return grid_h * grid_w // self.cfg.tokens_per_merge

    @torch.inference_mode()
    def forward(self, pixel_patches: torch.Tensor, grid_hw: list[tuple[int, int]]) -> torch.Tensor:
        """pixel_patches `[N, 3, P, P]` in raster order per image → `[M, H]` embeddings, images in order."""
        dtype = self.patch_proj.weight.dtype
        x = self.patch_proj(pixel_patches.to(dtype)).flatten(1)  # [N, D]
        x = x + self._position_embeddings(grid_hw).to(dtype)
        angles = _rope_angles(
            grid_hw, self.cfg.hidden_size // self.cfg.num_attention_heads, self.cfg.rope_theta
        ).to(x.device)  # built on the host from the grid
        cu = [0]
        for h, w in grid_hw:
            cu.append(cu[-1] + h * w)
        for block in self.blocks:
            x = block(x, angles, cu)
        x = self.final_layernorm(x)
        merged = torch.cat(
            [
                self._merge(x[s:e], h, w)
                for (s, e), (h, w) in zip(zip(cu[:-1], cu[1:], strict=True), grid_hw, strict=True)
            ]
        )
        merged = self.pre_norm(merged).flatten(1)  # [M, 4·D]
        projected: torch.Tensor = self.proj_out(F.gelu(self.proj_in(merged)))  # nn.Linear's call is untyped
        return projected

    def _position_embeddings(self, grid_hw: list[tuple[int, int]]) -> torch.Tensor:
        """The learned grid resampled (bicubic) to each image's patch grid, raster order: `[N, D]`."""
        table = self.pos_emb.permute(2, 0, 1)[None].float()  # [1, D, Hg, Wg]
        parts = []
        for h, w in grid_hw:
            if (h, w) == tuple(self.pos_emb.shape[:2]):
                grid = table
            else:
                grid = F.interpolate(table, size=(h, w), mode="bicubic", align_corners=False)
            parts.append(grid[0].flatten(1).T)
        return torch.cat(parts)

    def _merge(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """`[h*w, D]` raster → `[h*w/4, 4, D]`: each 2×2 block of patches becomes one token."""
        kh, kw = self.cfg.merge_kernel_size
        D = x.shape[-1]
        x = x.view(h // kh, kh, w // kw, kw, D).permute(0, 2, 1, 3, 4)
        return x.reshape(-1, kh * kw, D)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load `vision_tower.*` and `mm_projector.*` tensors (other names are ignored)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for raw_name, tensor in weights:
            name = _local_name(raw_name)
            if name is None:
                continue
            if name not in params:
                raise CheckpointError(f"unexpected vision tensor {raw_name!r}")
            target = params[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise CheckpointError(
                    f"vision tensor {raw_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(tensor.to(target.dtype))
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise CheckpointError(f"checkpoint is missing vision tensors: {', '.join(missing[:5])}")


_PREFIXES = (
    ("vision_tower.encoder.patch_embed.proj.", "patch_proj."),
    ("vision_tower.patch_embed.proj.", "patch_proj."),
    ("vision_tower.patch_embed.pos_emb.weight", "pos_emb"),
    ("vision_tower.encoder.final_layernorm.", "final_layernorm."),
    ("vision_tower.encoder.blocks.", "blocks."),
    ("mm_projector.pre_norm.", "pre_norm."),
    ("mm_projector.proj.0.", "proj_in."),
    ("mm_projector.proj.2.", "proj_out."),
)


def _local_name(name: str) -> str | None:
    """Map a checkpoint name to this module's parameter name, or None if it is not a vision tensor."""
    if name.startswith("model."):
        name = name[len("model.") :]
    for prefix, local in _PREFIXES:
        if name.startswith(prefix):
            rest = name[len(prefix) :]
            if local == "blocks.":
                rest = rest.replace(".mlp.fc0.", ".fc0.").replace(".mlp.fc1.", ".fc1.")
            return local + rest
    return None


def is_vision_tensor(name: str) -> bool:
    return _local_name(name) is not None
