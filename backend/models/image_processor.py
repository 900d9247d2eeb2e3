"""Image preprocessing for MoonViT (Kimi K2.5 / K2.6): decode, resize, pad, normalise, patchify.

Follows the checkpoint's processor: resize (bicubic, never upscaling) so that at most `max_patches`
patches and `max_side` pixels per side remain, pad right/bottom with zeros to a multiple of
patch × merge, rescale to [0, 1], normalise with mean = std = 0.5, cut into raster-ordered patches.
The image hash (bytes and resulting grid) goes into the prefix-cache key.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from backend.errors import InvalidRequest

MEAN = 0.5
STD = 0.5
MAX_PIXELS = 64 * 1024 * 1024  # refused before decoding: bigger than any image worth resizing down


@dataclass(frozen=True, slots=True)
class ProcessedImage:
    patches: torch.Tensor  # [gh*gw, 3, P, P] float32, raster order
    grid_h: int
    grid_w: int
    image_hash: str  # hex SHA-256 over the bytes and the grid


def target_size(
    height: int, width: int, patch: int, merge: int, max_patches: int, max_side: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized_h, resized_w), (padded_h, padded_w)) as the Kimi K2.5 processor computes them."""
    patches_h = max(1.0, height // patch)
    patches_w = max(1.0, width // patch)
    scale = min(
        1.0,
        math.sqrt(max_patches / (patches_h * patches_w)),
        (max_side * patch) / height,
        (max_side * patch) / width,
    )
    new_h = min(max(1, int(height * scale)), max_side * patch)
    new_w = min(max(1, int(width * scale)), max_side * patch)
    factor = merge * patch
    return (new_h, new_w), (
        new_h + (factor - new_h % factor) % factor,
        new_w + (factor - new_w % factor) % factor,
    )


def num_patches(
    data: bytes, *, patch: int = 14, merge: int = 2, max_patches: int = 16384, max_side: int = 512
) -> int:
    """The patches `process_image` will cut from `data`, from its header alone (nothing decoded)."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            height, width = image.height, image.width
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequest(f"image could not be decoded: {exc}") from exc
    _, (pad_h, pad_w) = target_size(height, width, patch, merge, max_patches, max_side)
    return (pad_h // patch) * (pad_w // patch)


def process_image(
    data: bytes, *, patch: int = 14, merge: int = 2, max_patches: int = 16384, max_side: int = 512
) -> ProcessedImage:
    try:
        image: Image.Image = Image.open(io.BytesIO(data))  # reads the header only
        if image.width * image.height > MAX_PIXELS:
            raise InvalidRequest(
                f"image is {image.width}x{image.height} pixels, more than the {MAX_PIXELS} this model accepts"
            )
        image.draft("RGB", (max_side * patch, max_side * patch))  # JPEG: decode at reduced scale
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequest(f"image could not be decoded: {exc}") from exc
    image = image.convert("RGB")
    (new_h, new_w), (pad_h, pad_w) = target_size(
        image.height, image.width, patch, merge, max_patches, max_side
    )
    if (new_h, new_w) != (image.height, image.width):
        image = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1)  # [3, h, w]
    padded = torch.zeros(3, pad_h, pad_w)
    padded[:, :new_h, :new_w] = pixels
    padded = (padded / 255.0 - MEAN) / STD
    gh, gw = pad_h // patch, pad_w // patch
    patches = padded.view(3, gh, patch, gw, patch).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3, patch, patch)
    digest = hashlib.sha256(data)
    digest.update(f"{gh}x{gw}".encode())
    return ProcessedImage(patches=patches, grid_h=gh, grid_w=gw, image_hash=digest.hexdigest())
