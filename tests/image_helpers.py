"""Generated test images, shared by the image tests."""

from __future__ import annotations

import io

import numpy as np


def generated_image(width: int = 40, height: int = 28, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A generated image: gradients plus noise (no flat regions, so a misplaced patch shows)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    px = np.stack([x * 255 // width, y * 255 // height, (x + y) * 127 // (width + height)], -1)
    px = np.clip(px + rng.integers(-40, 40, px.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px, "RGB").save(buf, fmt)
    return buf.getvalue()
