"""Images into the prompt for Kimi K2.5 / K2.6 (the serving side of the MoonViT tower).

The chat template leaves one `<|media_pad|>` per image (`<|media_begin|>image<|media_content|>
<|media_pad|><|media_end|>`). Each image is preprocessed (resize, pad, patches), run through the
tower (2×2 merge + projector), and its placeholder is widened to one pad token per merged patch; the
engine then puts the embeddings at those positions. Each span carries the image hash, which the
prefix cache chains into its page keys, so two different images never share cached pages.

Images are the costliest input per byte (a 65 KB PNG at the pixel cap is 16,384 patches under full
attention), so the encoder bounds them (`ImageBudget`): the patches of one request's images
together, counted from their headers before anything is decoded (413 past the cap); how many
requests encode at once, and how many more may wait (429 when full). The `n` choices of one
request carry the same images and arrive together: they share one encoding (by the images'
digest within the tenant's salt), so a request's images are prepared, and counted, once. Never
across tenants: a hit skips the encoder (and its queue), and the time to a first token would tell
a tenant whether another had just sent the same picture.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.errors import Busy, InvalidRequest, TooManyImagePatches
from backend.models.checkpoint import iter_tensors
from backend.models.image_processor import ProcessedImage, num_patches, process_image
from backend.models.moonvit import MoonViT, VisionConfig, is_vision_tensor
from schemas.backend import ImagePart, ImageSpan

MEDIA_PAD = "<|media_pad|>"


@dataclass(frozen=True)
class ImageBudget:
    """What one replica spends on images: patches per request (all its images together; the
    default is two images at the per-image cap, 130 × 130 patches each once padded), requests
    encoding at once and waiting for their turn, and how long a finished encoding stays shared
    with choices arriving late."""

    max_patches_per_request: int = 2 * 130 * 130
    max_concurrent: int = 1
    max_waiting: int = 16  # each waits in a worker thread (of 40): text requests keep the rest
    share_for_s: float = 10.0


Encoded = tuple[list[ProcessedImage], torch.Tensor]  # the images, their embeddings [M, hidden]


class VisionEncoder:
    def __init__(
        self,
        tower: MoonViT,
        pad_token_id: int,
        *,
        max_patches: int = 16384,
        max_side: int = 512,
        budget: ImageBudget | None = None,
    ) -> None:
        self._tower = tower
        self._pad_id = pad_token_id
        self._max_patches, self._max_side = max_patches, max_side
        self.budget = budget or ImageBudget()
        self._lock = threading.Lock()  # `expand` runs in worker threads
        self._turns = threading.Semaphore(self.budget.max_concurrent)
        self._num_admitted = 0  # encoding or waiting for a turn
        self._in_flight: dict[str, Future[Encoded]] = {}
        self._recent: OrderedDict[str, tuple[float, Encoded]] = OrderedDict()

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        pad_token_id: int | None,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        budget: ImageBudget | None = None,
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
        return cls(tower.eval(), pad_token_id, budget=budget)

    def expand(
        self, token_ids: list[int], images: list[ImagePart], scope: str = ""
    ) -> tuple[list[int], list[ImageSpan], torch.Tensor]:
        """(ids with each placeholder widened, one span per image, `[sum of span lengths, hidden]`
        embeddings). `scope`: whose encodings this one may share (the request's tenant salt)."""
        slots = [i for i, t in enumerate(token_ids) if t == self._pad_id]
        if len(slots) != len(images):
            raise InvalidRequest(f"{len(images)} images but {len(slots)} image placeholders in the prompt.")
        processed, embeds = self._shared(images, scope)
        grids = [(p.grid_h, p.grid_w) for p in processed]
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

    # ---- cost bounds ------------------------------------------------------------------------------
    def _sizes(self) -> dict[str, int]:
        cfg = self._tower.cfg
        return {
            "patch": cfg.patch_size,
            "merge": cfg.merge_kernel_size[0],
            "max_patches": self._max_patches,
            "max_side": self._max_side,
        }

    def _shared(self, images: list[ImagePart], scope: str) -> Encoded:
        """The images' encoding: made here, or taken from a choice of the same request (the same
        `scope`) that is making (or just made) it."""
        digest = hashlib.sha256(scope.encode())
        for img in images:
            digest.update(hashlib.sha256(img.data).digest())
        key = digest.hexdigest()
        with self._lock:
            now = time.monotonic()
            while self._recent and next(iter(self._recent.values()))[0] < now:
                self._recent.popitem(last=False)
            if key in self._recent:
                return self._recent[key][1]
            future = self._in_flight.get(key)
            is_owner = future is None
            if future is None:
                future = self._in_flight[key] = Future()
        if not is_owner:
            return future.result()  # or raises what the owner raised (413, 429)
        try:
            encoded = self._bounded(lambda: self._encode(images), images)
        except BaseException as exc:
            future.set_exception(exc)
            raise
        finally:
            with self._lock:
                del self._in_flight[key]
        with self._lock:
            self._recent[key] = (time.monotonic() + self.budget.share_for_s, encoded)
            while len(self._recent) > 2 * self.budget.max_concurrent:
                self._recent.popitem(last=False)
        future.set_result(encoded)
        return encoded

    def _bounded(self, encode: Callable[[], Encoded], images: list[ImagePart]) -> Encoded:
        """Run `encode` under the budget: 413 past the patch cap (from the headers alone), 429 when
        every turn is taken and the waiting line is full."""
        sizes = self._sizes()
        num = sum(num_patches(img.data, **sizes) for img in images)
        cap = self.budget.max_patches_per_request
        if num > cap:
            raise TooManyImagePatches(
                f"The request's {len(images)} images make {num} patches; a request may have at most {cap} "
                "(send fewer or smaller images)."
            )
        with self._lock:
            if self._num_admitted >= self.budget.max_concurrent + self.budget.max_waiting:
                raise Busy("The image encoder is busy; try again shortly.")
            self._num_admitted += 1
        try:
            with self._turns:
                return encode()
        finally:
            with self._lock:
                self._num_admitted -= 1

    def _encode(self, images: list[ImagePart]) -> Encoded:
        processed = [process_image(img.data, **self._sizes()) for img in images]
        grids = [(p.grid_h, p.grid_w) for p in processed]
        device = next(self._tower.parameters()).device
        with torch.no_grad():
            embeds = self._tower(torch.cat([p.patches for p in processed]).to(device), grids)  # [M, hidden]
        return processed, embeds
