"""A chat message's content as a list of parts, text and images: OpenAI's shape, and
protocol v1's (docs/protocol.md, "Content parts").

    {"type": "text", "text": "What is in this picture?"}
    {"type": "image", "data": b"\\x89PNG..."}                    (protocol: msgpack bin)
    {"type": "image_url", "url": "data:image/png;base64,..."}    (protocol)
    {"type": "image_url", "image_url": {"url": "data:..."}}       (OpenAI)

``parse`` gives what the chat template renders (the text alone where there is no image;
else the parts, each image as ``{"type": "image"}``, where a vision-language model's
template puts its image tokens) and the images' encoded bytes, in order, each with the
field that carried it (for errors). Only data URLs are taken: nothing is fetched.
"""
from __future__ import annotations

import base64
import binascii
import re

from roseinfer.core.errors import InvalidRequestError, short

MAX_IMAGES = 16  # a prompt's images, at most
MAX_IMAGE_BYTES = 32 << 20  # an encoded image's bytes, at most
DATA_URL = re.compile(r"data:(image/[\w.+-]+)?(;[\w=.+-]+)*;base64,", re.ASCII)


def parse(content, field: str) -> tuple[str | list[dict], list[tuple[bytes, str]]]:
    """(content as the chat template takes it, its images as (encoded bytes, the part's
    field)) of a message's content: a string, or a list of parts. Raises
    InvalidRequestError naming the bad part."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise InvalidRequestError(field, f"must be a string or a list of content parts, got "
                                  f"{short(content)}")
    parts, images = [], []
    for j, part in enumerate(content):
        at = f"{field}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{at}.text", f"must be a string, got "
                                          f"{short(part.get('text'))}")
            parts.append({"type": "text", "text": part["text"]})
        elif kind in ("image", "image_url"):
            images.append((_image(part, at), at))
            parts.append({"type": "image"})
        else:
            raise InvalidRequestError(f"{at}.type", f"must be text, image or image_url, got "
                                      f"{short(kind)}")
    if not images:
        return "".join(p["text"] for p in parts), []
    return parts, images


def as_sent(content: str | list[dict], images: list[tuple[bytes, str]]) -> str | list[dict]:
    """``parse``'s result as protocol v1 sends it: each image part with its bytes."""
    if isinstance(content, str):
        return content
    data = iter(images)
    return [{"type": "image", "data": next(data)[0]} if p["type"] == "image" else p
            for p in content]


def text_chars(content) -> int:
    """The characters of a parsed content's text (its parts' text, images aside)."""
    if isinstance(content, str):
        return len(content)
    return sum(len(p.get("text", "")) for p in content)


def _image(part: dict, at: str) -> bytes:
    if part["type"] == "image":
        data = part.get("data")
        if not isinstance(data, (bytes, bytearray)):
            raise InvalidRequestError(f"{at}.data", "must be the image's encoded bytes (PNG, "
                                      f"JPEG or WebP; msgpack bin), got {short(data)}")
        return _bounded(bytes(data), at)
    url = part.get("url")
    if isinstance(part.get("image_url"), dict):  # OpenAI's shape
        url = part["image_url"].get("url")
    if not isinstance(url, str):
        raise InvalidRequestError(f"{at}.url", f"must be a data: URL, got {short(url)}")
    return data_url(url, f"{at}.url")


def data_url(url: str, field: str) -> bytes:
    """The bytes of a base64 data URL of an image; anything else refused by name."""
    head = DATA_URL.match(url)
    if head is None:
        kind = "an http(s) URL" if url.startswith(("http://", "https://")) else "not a data URL"
        raise InvalidRequestError(field, f"{kind} ({short(url[:64])}): images come as data "
                                  "URLs (data:image/png;base64,...) or as bytes (type image, "
                                  "data); nothing is fetched")
    encoded = url[head.end():]
    if len(encoded) // 4 * 3 > MAX_IMAGE_BYTES:  # before decoding it
        raise InvalidRequestError(field, f"an image of about {len(encoded) // 4 * 3:,} bytes; "
                                  f"at most {MAX_IMAGE_BYTES:,}: send it smaller", "too_long")
    try:
        return base64.b64decode(encoded, validate=True)
    except binascii.Error:
        raise InvalidRequestError(field, "is not valid base64 after its data: header") from None


def _bounded(data: bytes, field: str) -> bytes:
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidRequestError(field, f"an image of {len(data):,} bytes; at most "
                                  f"{MAX_IMAGE_BYTES:,}: send it smaller", "too_long")
    return data
