"""Images into the prompt for Kimi K2.5 / K2.6 (the serving side of the MoonViT tower).

The chat template leaves one `<|media_pad|>` per image (`<|media_begin|>image<|media_content|>
<|media_pad|><|media_end|>`). Each image is preprocessed (resize, pad, patches), run through the
tower (2×2 merge + projector), and its placeholder is widened to one pad token per merged patch; the
engine then puts the embeddings at those positions. Each span carries the image hash, which the
prefix cache chains into its page keys, so two different images never share cached pages.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from backend.errors import InvalidRequest
from backend.models.checkpoint import iter_tensors
from backend.models.image_processor import process_image
from backend.models.moonvit import MoonViT, VisionConfig, is_vision_tensor
from schemas.backend import ImagePart, ImageSpan

MEDIA_PAD = "<|media_pad|>"


class VisionEncoder:
    def __init__(
        self, tower: MoonViT, pad_token_id: int, *, max_patches: int = 16384, max_side: int = 512
    ) -> None:
        self._tower = tower
        self._pad_id = pad_token_id
        self._max_patches, self._max_side = max_patches, max_side

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        pad_token_id: int | None,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> VisionEncoder | None:
        """The checkpoint's tower, or None when it has none (a text-only model refuses images)."""
        folder = Path(path)
        raw = json.loads((folder / "config.json").read_text())
        if "vision_config" not in raw or pad_token_id is None:
            return None
        text_hidden = (raw.get("text_config") or raw)["hidden_size"]
        with torch.device(device):
            tower = MoonViT(VisionConfig.from_config(raw, text_hidden_size=text_hidden), dtype=dtype)
        tower.load_weights((name, t) for name, t in iter_tensors(folder) if is_vision_tensor(name))
        return cls(tower.eval(), pad_token_id)

    def expand(
        self, token_ids: list[int], images: list[ImagePart]
    ) -> tuple[list[int], list[ImageSpan], torch.Tensor]:
        """(ids with each placeholder widened, one span per image, `[sum of span lengths, hidden]` embeddings)."""
        slots = [i for i, t in enumerate(token_ids) if t == self._pad_id]
        if len(slots) != len(images):
            raise InvalidRequest(f"{len(images)} images but {len(slots)} image placeholders in the prompt.")
        cfg = self._tower.cfg
        processed = [
            process_image(
                img.data,
                patch=cfg.patch_size,
                merge=cfg.merge_kernel_size[0],
                max_patches=self._max_patches,
                max_side=self._max_side,
            )
            for img in images
        ]
        grids = [(p.grid_h, p.grid_w) for p in processed]
        device = next(self._tower.parameters()).device
        embeds = self._tower(torch.cat([p.patches for p in processed]).to(device), grids)  # [M, hidden]
        ids: list[int] = []
        spans: list[ImageSpan] = []
        start = 0
        for slot, image, (gh, gw) in zip(slots, processed, grids, strict=True):
            ids.extend(token_ids[start:slot])
            length = self._tower.num_tokens(gh, gw)
            spans.append(ImageSpan(offset=len(ids), length=length, image_hash=image.image_hash))
            ids.extend([self._pad_id] * length)
            start = slot + 1
        ids.extend(token_ids[start:])
        return ids, spans, embeds
