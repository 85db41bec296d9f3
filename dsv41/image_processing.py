"""Images on the host: decoding (Pillow), the release's resize and patching, and the token span an image takes.

The sizing follows the reference processor (nemo-automodel `deepseek_v41/processing.py`, the released one):
an image smaller than `min_pixels` is scaled up to that area; its sides are rounded up to whole patches; if the
span would exceed `max_image_tokens`, the largest grid of whole merged cells (patch x downsample pixels) that
keeps the aspect ratio and fits is taken. The image is then fitted into that canvas, aspect kept, centred on
grey (127) — or stretched, for an image wider than `max_wh_ratio`. Pixels map to [-1, 1] and are rounded to
bf16, as the reference hands them to the tower.

Span layout (the image token id at every position):

    START, (IMAGE x llm_w, NEWLINE) x llm_h, END        llm_h/w = ceil(ViT rows/columns / downsample_ratio)

The tower's inputs are padded to a few bucket sizes so that images of many sizes share compiled programs:
`VisionInputs` carries the padded patches with their grid positions and a validity mask, and, per span row,
which ViT rows the aligner merges into it.
"""

from __future__ import annotations

import dataclasses
import io
import math

import ml_dtypes
import numpy as np

from dsv41.config import VisionConfig

# token types inside a span (the reference's vision_token_types); PAD marks bucket rows past the span
START, IMAGE, NEWLINE, END, PAD = 0, 1, 2, 3, 4
GREY = (127, 127, 127)


class ImageError(ValueError):
    """An image that cannot be decoded or cannot fit the configured token budget."""


@dataclasses.dataclass(frozen=True)
class ImageGrid:
    """An image's ViT patch grid (vit_h x vit_w patches) and the span it becomes."""

    vit_h: int
    vit_w: int
    ratio: int  # downsample_ratio: ratio x ratio patches merge into one image token

    @property
    def llm_h(self) -> int:
        return -(-self.vit_h // self.ratio)

    @property
    def llm_w(self) -> int:
        return -(-self.vit_w // self.ratio)

    @property
    def n_patches(self) -> int:
        return self.vit_h * self.vit_w

    @property
    def span_len(self) -> int:
        return self.llm_h * (self.llm_w + 1) + 2

    def token_types(self) -> np.ndarray:
        """int8 [span_len]: START, rows of IMAGE each closed by NEWLINE, END."""
        row = [IMAGE] * self.llm_w + [NEWLINE]
        return np.asarray([START] + row * self.llm_h + [END], np.int8)


def plan_grid(width: int, height: int, v: VisionConfig) -> tuple[ImageGrid, tuple[int, int]]:
    """Image size in pixels -> (its grid, the canvas (width, height) in pixels it is fitted into)."""
    if width <= 0 or height <= 0:
        raise ImageError(f"image of {width}x{height} pixels: both sides must be positive")
    P, r, budget = v.patch_size, v.downsample_ratio, v.max_image_tokens
    w: float = width
    h: float = height
    if v.max_wh_ratio is not None and width > height * v.max_wh_ratio:
        w = height * v.max_wh_ratio
    if w * h < v.min_pixels:
        up = math.sqrt(v.min_pixels / (w * h))
        w, h = int(w * up), int(h * up)
    cw, ch = math.ceil(w / P) * P, math.ceil(h / P) * P

    def span(cw: int, ch: int) -> int:
        return ImageGrid(ch // P, cw // P, r).span_len

    if span(cw, ch) > budget:
        # the widest grid of whole cells with this aspect whose span fits: rows * (cols + 1) + 2 <= budget
        aspect = h / w
        cols = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
        rows = cols * aspect
        cell = P * r
        if cols < 1:
            ch, cw = (budget - 2) // 2 * cell, cell
        elif rows < 1:
            ch, cw = cell, (budget - 3) * cell
        else:
            scale = min(math.floor(cols) * cell / w, math.floor(rows) * cell / h)
            ch, cw = math.floor(h * scale / P) * P, math.floor(w * scale / P) * P
    if min(cw, ch) <= 0 or span(cw, ch) > budget:
        raise ImageError(f"an image of {width}x{height} pixels cannot fit max_image_tokens={budget}")
    return ImageGrid(ch // P, cw // P, r), (cw, ch)


def decode(data: bytes, max_pixels: int | None = None):
    """Encoded image bytes (PNG, JPEG, WebP, anything Pillow reads) -> an RGB PIL image. max_pixels: refuse
    larger images before their pixels are decoded."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            if max_pixels is not None and im.width * im.height > max_pixels:
                raise ImageError(f"image of {im.width}x{im.height} pixels exceeds the limit of {max_pixels} pixels")
            return im.convert("RGB")  # alpha dropped, not composited: as the reference loads images
    except ImageError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"cannot decode the image ({type(e).__name__}: {e})") from None


@dataclasses.dataclass(frozen=True)
class PreparedImage:
    """patches float32 [vit_h * vit_w, 3 * P * P] (values on the bf16 grid), row-major over the grid, each patch
    channel-major (c, y, x) as the patch embedding reads it."""

    patches: np.ndarray
    grid: ImageGrid


def preprocess(image, v: VisionConfig) -> PreparedImage:
    """A PIL image (any mode) -> its patches and grid."""
    from PIL import ImageOps

    image = image.convert("RGB")
    grid, (cw, ch) = plan_grid(image.width, image.height, v)
    if v.max_wh_ratio is not None and image.width >= v.max_wh_ratio * image.height:
        image = image.resize((cw, ch))
    else:
        image = ImageOps.pad(image, (cw, ch), color=GREY)
    x = np.asarray(image, np.float32) / 255.0
    x = ((x - 0.5) / 0.5).astype(ml_dtypes.bfloat16).astype(np.float32)  # [ch, cw, 3]
    P = v.patch_size
    x = x.transpose(2, 0, 1).reshape(3, grid.vit_h, P, grid.vit_w, P).transpose(1, 3, 0, 2, 4)
    return PreparedImage(np.ascontiguousarray(x.reshape(grid.n_patches, 3 * P * P)), grid)


# ---- the tower's padded inputs ---------------------------------------------------------------------------------


def patch_bucket(n: int, v: VisionConfig) -> int:
    """Padded patch count: n rounded up to an eighth of its power of two (at most 12.5% padding; a few
    compiled programs per doubling of image area), and to no more than the most patches a span can hold
    (rows x columns <= max_image_tokens - 3 cells of ratio^2 patches), rounded up to 64."""
    if n <= 64:
        return 64
    step = 1 << (math.ceil(math.log2(n)) - 3)
    most = -(-(v.max_image_tokens - 3) * v.downsample_ratio ** 2 // 64) * 64
    return min(-(-n // step) * step, max(most, n))


@dataclasses.dataclass(frozen=True)
class VisionInputs:
    """One image for `vision.span_embeddings`, padded to a bucket (N patches, S = max_image_tokens span rows).

    patches float32 [N, 3 * P * P]; pos int32 [N, 2] (row, column of each patch; 0 for padding); valid bool [N];
    merge int32 [S, ratio^2]: per span row, the ViT rows its image token merges (row-major within the cell,
    N = a zero row, for cells past the grid's ragged edge and for non-IMAGE rows); types int8 [S]: START /
    IMAGE / NEWLINE / END, PAD past the span.
    """

    patches: np.ndarray
    pos: np.ndarray
    valid: np.ndarray
    merge: np.ndarray
    types: np.ndarray
    span_len: int


def vision_inputs(prepared: PreparedImage, v: VisionConfig) -> VisionInputs:
    g = prepared.grid
    r = g.ratio
    n = g.n_patches
    N, S = patch_bucket(n, v), v.max_image_tokens
    patches = np.zeros((N, prepared.patches.shape[1]), np.float32)
    patches[:n] = prepared.patches
    rows, cols = np.divmod(np.arange(n, dtype=np.int32), g.vit_w)
    pos = np.zeros((N, 2), np.int32)
    pos[:n, 0], pos[:n, 1] = rows, cols
    valid = np.arange(N) < n
    types = np.full((S,), PAD, np.int8)
    types[: g.span_len] = g.token_types()
    # the ViT row of every pixel of the merged grid, N (the zero row) past the ragged edge
    H, W = g.llm_h * r, g.llm_w * r
    yy, xx = np.meshgrid(np.arange(H), np.arange(W), indexing="ij")
    src = np.where((yy < g.vit_h) & (xx < g.vit_w), yy * g.vit_w + xx, N).astype(np.int32)
    cells = src.reshape(g.llm_h, r, g.llm_w, r).transpose(0, 2, 1, 3).reshape(g.llm_h * g.llm_w, r * r)
    merge = np.full((S, r * r), N, np.int32)
    merge[np.flatnonzero(types == IMAGE)] = cells
    return VisionInputs(patches, pos, valid, merge, types, g.span_len)


def expand_spans(ids, grids, image_token_id: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Prompt ids with one image token per image -> (int32 ids with each expanded into its image's span, the
    spans as (start, length) in order)."""
    ids = np.asarray(ids, np.int64).ravel()
    at = np.flatnonzero(ids == image_token_id)
    if len(at) != len(grids):
        raise ImageError(f"the prompt has {len(at)} image tokens but {len(grids)} images were given")
    out, spans, prev = [], [], 0
    for k, g in zip(at, grids):
        out.append(ids[prev:k])
        start = sum(len(o) for o in out)
        spans.append((start, g.span_len))
        out.append(np.full((g.span_len,), image_token_id, np.int64))
        prev = k + 1
    out.append(ids[prev:])
    return np.concatenate(out).astype(np.int32), spans
