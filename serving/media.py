"""Images of chat requests: `image_url` parts -> encoded bytes -> the engine's `PromptImage`s, within the server's
limits. Every refusal is a 400 that names the limit and the flag that sets it.

URLs: `data:` URLs with base64 PNG / JPEG / WebP (anything Pillow decodes) always; http(s) only for hosts listed
by `--allowed-media-domains` (none by default: the server then fetches nothing a client names).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from dsv41 import image_processing as ip
from serving.errors import bad_request

DEFAULT_MAX_IMAGE_BYTES = 20 << 20
DEFAULT_MAX_IMAGES = 8
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192
FETCH_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class MediaConfig:
    """The server's image limits (`dsv41 serve` flags in brackets)."""

    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # encoded size of one image [--max-image-bytes]
    max_images: int = DEFAULT_MAX_IMAGES  # per request [--max-images-per-request]
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width x height of one image [--max-image-pixels]
    allowed_media_domains: tuple[str, ...] = ()  # hosts http(s) images may come from [--allowed-media-domains]


def _url_of(part: dict[str, Any]) -> str:
    url = part.get("image_url")
    return url.get("url", "") if isinstance(url, dict) else str(url or "")


def image_bytes(url: str, media: MediaConfig, k: int) -> bytes:
    """One image_url's encoded bytes. k: the image's index (for messages)."""
    where = f"image {k}"
    if url.startswith("data:"):
        head, sep, payload = url[5:].partition(",")
        if not sep or not head.endswith(";base64"):
            raise bad_request(f"{where}: a data: URL must be base64 (data:image/png;base64,...)", "messages")
        if len(payload) * 3 // 4 > media.max_image_bytes + 3:
            raise _too_big(where, len(payload) * 3 // 4, media)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(f"{where}: the data: URL's payload is not valid base64", "messages") from None
    elif url.startswith(("http://", "https://")):
        host = urllib.parse.urlsplit(url).hostname or ""
        if host not in media.allowed_media_domains:
            raise bad_request(f"{where}: fetching images from {host!r} is not allowed; send the image as a data: "
                              "URL, or start the server with --allowed-media-domains listing the host", "messages",
                              "unsupported")
        data = _fetch(url, media, where)
    else:
        scheme = url.split(":", 1)[0] if ":" in url else url[:20]
        raise bad_request(f"{where}: image URLs must be data: URLs (or http(s) from --allowed-media-domains), got "
                          f"{scheme!r}", "messages", "unsupported")
    if len(data) > media.max_image_bytes:
        raise _too_big(where, len(data), media)
    return data


def _too_big(where: str, n: int, media: MediaConfig):
    return bad_request(f"{where} is {n} bytes, over the limit of {media.max_image_bytes} bytes (--max-image-bytes)",
                       "messages", "image_too_large")


class _AllowListedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed host: the allow-list bounds what the server fetches, not only the
    URL a client wrote."""

    def __init__(self, hosts: tuple[str, ...]) -> None:
        self.hosts = hosts

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        host = urllib.parse.urlsplit(newurl).hostname or ""
        if host not in self.hosts:
            raise urllib.error.HTTPError(newurl, code, f"redirected to {host!r}, which --allowed-media-domains does "
                                                       "not list", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, media: MediaConfig, where: str) -> bytes:
    req = urllib.request.Request(url, headers={"User-Agent": "dsv41"})
    opener = urllib.request.build_opener(_AllowListedRedirects(media.allowed_media_domains))
    try:
        with opener.open(req, timeout=FETCH_TIMEOUT_S) as resp:
            data = resp.read(media.max_image_bytes + 1)
    except OSError as e:
        raise bad_request(f"{where}: fetching {url[:200]} failed ({e})", "messages", "image_fetch_failed") from None
    return data


def prompt_images(messages: list[dict[str, Any]], media: MediaConfig, cfg) -> list[tuple[bytes, ip.PreparedImage]]:
    """The messages' images, decoded and preprocessed for the model (cfg: its ModelConfig), in prompt order."""
    from dsv41 import chat

    parts = chat.image_parts(messages)
    if not parts:
        return []
    if cfg is None or cfg.vision is None:
        raise bad_request("this model has no vision input (its config.json has no vision_config); send text parts "
                          "only", "messages", "unsupported")
    if len(parts) > media.max_images:
        raise bad_request(f"the request has {len(parts)} images, over the limit of {media.max_images} per request "
                          "(--max-images-per-request)", "messages", "too_many_images")
    out = []
    for k, part in enumerate(parts):
        data = image_bytes(_url_of(part), media, k)
        try:
            prepared = ip.preprocess(ip.decode(data, media.max_image_pixels), cfg.vision)
        except ip.ImageError as e:
            hint = " (--max-image-pixels)" if "pixels" in str(e) else ""
            raise bad_request(f"image {k}: {e}{hint}", "messages", "invalid_image") from None
        out.append((data, prepared))
    return out


def place(ids: list[int], images: list[tuple[bytes, ip.PreparedImage]], cfg) -> tuple[list[int], tuple]:
    """Prompt ids with one image token per image -> (ids with the spans expanded, the engine's PromptImages)."""
    if not images:
        return ids, ()
    from serving.engine.images import PromptImage  # (jax: not imported by a server that gets no images)

    out, spans = ip.expand_spans(ids, [p.grid for _, p in images], cfg.image_token_id)
    return [int(t) for t in out], tuple(PromptImage.of(s, d, p, cfg.vision) for (s, _), (d, p) in zip(spans, images))
