"""Images given by http(s) URL, fetched by the gateway from the domains its operator
allows (``--allowed-media-domains``), never from anywhere else: each becomes a data URL
in the body before it is read, so the worker, which fetches nothing, gets the bytes.

Bounded: at most ``MAX_IMAGES`` URLs a call, each at most ``MAX_IMAGE_BYTES`` (the
worker's own limit) and ``timeout_s`` seconds; no redirects followed (one could lead off
the allowed hosts); a host matches an allowed domain exactly. Everything else is refused
naming the part, with OpenAI's error shape.
"""
from __future__ import annotations

import asyncio
import base64
from urllib.parse import urlsplit

from roseinfer.core.content_parts import MAX_IMAGE_BYTES, MAX_IMAGES
from roseinfer.frontends.openai.mapping import bad

DEFAULT_TIMEOUT_S = 10.0


class MediaFetcher:
    def __init__(self, allowed_domains, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.allowed = {d.strip().lower() for d in allowed_domains if d.strip()}
        self.timeout_s = timeout_s

    async def fetched(self, body: dict) -> dict:
        """``body`` with the http(s) image URLs of its messages (chat) or input items
        (Responses) replaced by data URLs; the body itself when it has none. Raises
        APIError (400) naming a part that cannot be fetched."""
        found = [(field, part, key) for field, part, key in _image_urls(body)
                 if _url(part, key).startswith(("http://", "https://"))]
        if not found:
            return body
        if len(found) > MAX_IMAGES:
            raise bad(found[MAX_IMAGES][0], f"{len(found)} image URLs; at most {MAX_IMAGES}")
        for field, part, key in found:
            host = (urlsplit(_url(part, key)).hostname or "").lower()
            if host not in self.allowed:
                raise bad(field, f"images are fetched only from the gateway's "
                          f"--allowed-media-domains ({', '.join(sorted(self.allowed)) or 'none'}), "
                          f"not {host!r}; send the image as a data URL")
        import httpx

        async with httpx.AsyncClient(follow_redirects=False, timeout=self.timeout_s) as client:
            data = await asyncio.gather(*(self._get(client, _url(part, key), field)
                                          for field, part, key in found))
        replaced = {id(part): (key, url) for (_, part, key), url in zip(found, data)}
        return _with_urls(body, replaced)

    async def _get(self, client, url: str, field: str) -> str:
        import httpx

        try:
            async with asyncio.timeout(self.timeout_s):
                async with client.stream("GET", url) as response:
                    if response.status_code != 200:
                        raise bad(field, f"fetching {url[:100]} gave HTTP "
                                  f"{response.status_code}{' (redirects are not followed)' if response.is_redirect else ''}")
                    data = bytearray()
                    async for piece in response.aiter_bytes():
                        data += piece
                        if len(data) > MAX_IMAGE_BYTES:
                            raise bad(field, f"the image at {url[:100]} is over "
                                      f"{MAX_IMAGE_BYTES:,} bytes")
                    kind = response.headers.get("content-type", "image/png").split(";")[0]
        except TimeoutError:
            raise bad(field, f"fetching {url[:100]} took over {self.timeout_s:g} s") from None
        except httpx.HTTPError as e:
            raise bad(field, f"cannot fetch {url[:100]} ({type(e).__name__})") from None
        if not kind.startswith("image/"):
            kind = "image/png"  # the worker reads the bytes, whatever the header says
        return f"data:{kind};base64,{base64.b64encode(bytes(data)).decode()}"


def _image_urls(body: dict):
    """(field, part, key) of every image URL part: chat's ``messages`` and Responses'
    ``input`` items, OpenAI's shapes (``image_url.url``, ``input_image``'s ``image_url``)
    and protocol v1's (``url``)."""
    for name in ("messages", "input"):
        items = body.get(name)
        for i, item in enumerate(items if isinstance(items, list) else []):
            content = item.get("content") if isinstance(item, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else []):
                if not isinstance(part, dict):
                    continue
                field = f"{name}[{i}].content[{j}]"
                if isinstance(part.get("image_url"), dict):
                    yield field, part["image_url"], "url"
                elif part.get("type") == "input_image" and isinstance(part.get("image_url"), str):
                    yield field, part, "image_url"
                elif part.get("type") == "image_url" and isinstance(part.get("url"), str):
                    yield field, part, "url"


def _url(part: dict, key: str) -> str:
    value = part.get(key)
    return value if isinstance(value, str) else ""


def _with_urls(value, replaced: dict):
    """A copy of ``value`` (its dicts and lists) where each dict in ``replaced`` (by id)
    has its key's new URL: the client's body is left as it came."""
    if isinstance(value, dict):
        out = {k: _with_urls(v, replaced) for k, v in value.items()}
        if id(value) in replaced:
            key, url = replaced[id(value)]
            out[key] = url
        return out
    if isinstance(value, list):
        return [_with_urls(v, replaced) for v in value]
    return value
