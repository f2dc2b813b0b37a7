"""Chat content parts (core/content_parts.py) as protocol v1 reads them: text parts alone
render as one string, images come out as bytes in order with the field that carried
them, and every bad part is refused naming it."""
import base64

import msgpack
import pytest

from roseinfer.core import content_parts
from roseinfer.core.errors import InvalidRequestError
from roseinfer.frontends.redis_streams.protocol import Chat
from roseinfer.frontends.redis_streams.request_entry import decode_request

PNG = b"\x89PNG\r\n\x1a\n-some-bytes"
URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


def test_text_parts_alone_render_as_one_string():
    assert content_parts.parse([{"type": "text", "text": "a "}, {"type": "text", "text": "b"}],
                               "c") == ("a b", [])
    assert content_parts.parse("plain", "c") == ("plain", [])


def test_images_in_each_shape_come_out_as_bytes_in_order():
    content, images = content_parts.parse([
        {"type": "text", "text": "look:"}, {"type": "image", "data": PNG},
        {"type": "image_url", "url": URL},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;charset=x;base64,AAEC",
                                            "detail": "high"}}], "m.content")
    assert content == [{"type": "text", "text": "look:"}] + [{"type": "image"}] * 3
    assert images == [(PNG, "m.content[1]"), (PNG, "m.content[2]"),
                      (b"\x00\x01\x02", "m.content[3]")]
    assert content_parts.text_chars(content) == 5
    sent = content_parts.as_sent(content, images)
    assert sent[1:] == [{"type": "image", "data": d} for d in (PNG, PNG, b"\x00\x01\x02")]


@pytest.mark.parametrize("part, field, match", [
    ({"type": "image_url", "url": "https://example.com/a.png"}, "c[0].url", "an http"),
    ({"type": "image_url", "url": "file:///etc/passwd"}, "c[0].url", "not a data URL"),
    ({"type": "image_url", "url": "data:image/png;base64,%%%"}, "c[0].url", "not valid base64"),
    ({"type": "image_url", "url": "data:image/png;base64," + "A" * (44 << 20)}, "c[0].url",
     "at most 33,554,432"),
    ({"type": "image_url", "image_url": "no"}, "c[0].url", "data: URL"),
    ({"type": "image", "data": "text"}, "c[0].data", "encoded bytes"),
    ({"type": "image", "data": b"\x00" * (33 << 20)}, "c[0]", "at most 33,554,432"),
    ({"type": "text", "text": 3}, "c[0].text", "must be a string"),
    ({"type": "audio"}, "c[0].type", "text, image or image_url"),
    ("not a map", "c[0].type", "text, image or image_url"),
])
def test_bad_parts_are_refused_naming_them(part, field, match):
    with pytest.raises(InvalidRequestError, match=match) as refused:
        content_parts.parse([part], "c")
    assert refused.value.field == field
    with pytest.raises(InvalidRequestError, match="a list of content parts"):
        content_parts.parse({"type": "text"}, "c")


def test_a_request_entry_carries_its_images_with_their_fields():
    body = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "data": PNG},
                                     {"type": "text", "text": "and"},
                                     {"type": "image_url", "url": URL}]}]}
    req = decode_request("1-0", {b"body": msgpack.packb(body)})
    assert isinstance(req.prompt, Chat)
    assert req.prompt.messages[1]["content"] == [{"type": "image"}, {"type": "text", "text": "and"},
                                                 {"type": "image"}]
    assert req.prompt.images == [(PNG, "messages[1].content[0]"),
                                 (PNG, "messages[1].content[2]")]
    body["messages"][1]["content"][1] = {"type": "text"}
    with pytest.raises(InvalidRequestError, match=r"messages\[1\].content\[1\].text"):
        decode_request("1-0", {b"body": msgpack.packb(body)})
