"""Images in a prompt, for vision-language models (models/qwen2_5_vl.py).

A prompt with images is a dict, as vLLM names it: ``{"prompt": text}`` or
``{"prompt_token_ids": ids}``, with ``"multi_modal_data": {"image": image or [images]}``
(PIL images, PNG/JPEG/WebP bytes, or ``Pixels`` already prepared). The prompt holds one
image token a picture (the chat template's ``<|vision_start|><|image_pad|><|vision_end|>``).
The model's image processor prepares the images (``preprocess``: a worker does it in its
reader thread, off the step loop); when the request comes in (``prepare``) each image token
is widened to as many as the image has features; the features, from the encoder cache or
from the vision tower a step later (core/image_encoder.py), stay with the sequence
(``Images``), with every prompt token's three-part position. A step
then puts each image token's feature in place of its embedding and gives every token its
position (``step_inputs``). The images' pixels are hashed into the sequence's block-hash
root (core/blocks.py), so cached blocks are shared only by prompts with the same images.

Past the prompt an image sequence's three position components are equal, its index plus
an offset: its decode steps run the text path (CUDA graphs too) with each token's position
shifted by its sequence's offset (``shift_rows``). What the engine cannot do with them yet,
it turns off for such a model (``decided``): mixed CUDA graphs and the compiled CPU step.
"""
from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass, field

import torch

from roseinfer.core.config import turned_off
from roseinfer.core.content_parts import MAX_IMAGE_BYTES, MAX_IMAGES
from roseinfer.core.errors import InvalidRequestError

MAX_PIXELS = 64 << 20  # an image's pixels, at most, read from its header before decoding
PROMPT_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data"}


@dataclass(eq=False)  # one request's: found and dropped by identity
class Images:
    """A prompt's images as its sequence carries them. Their features come from the
    encoder cache or, a step at a time, from the vision tower (core/image_encoder.py):
    the sequence is admitted once ``features`` is set."""
    at: torch.Tensor  # [image tokens]: each one's index in the prompt
    positions3: torch.Tensor  # [3, prompt tokens]: M-RoPE positions (time, height, width)
    delta: int  # a token past the prompt at index i has position i + delta (all three)
    keys: list[int]  # each image's digest of its prepared pixels
    counts: list[int]  # each image's features (image tokens)
    grids: torch.Tensor  # [images, 3]: each one's (time, height, width) in patches
    patches: list  # each image's pixel patches; None once its features are found
    found: list  # each image's features, None until found
    features: torch.Tensor | None = None  # [image tokens, hidden]: all, in prompt order
    # each image's tokens [start, end) where they attend both ways (Gemma 3), else none
    spans: list = field(default_factory=list)

    @property
    def digest(self) -> int:
        return hash(tuple(self.keys))

    def missing(self) -> list[int]:
        return [i for i, f in enumerate(self.found) if f is None]

    def chunk(self, start: int, n: int, most: int) -> int:
        """The tokens of a prompt chunk from ``start`` of at most ``n``, where its images'
        tokens attend both ways: shortened to end before an image it would cut, or, one
        it starts inside (or at its first token), lengthened to that image's end, when
        ``most`` tokens allow it (else none: it waits for a step with room)."""
        for first, end in self.spans:
            if first < start + n < end:
                if first > start:
                    return first - start
                return end - start if end - start <= most else 0
        return n

    def complete(self, device: torch.device) -> None:
        """Every image found: their features, in order, on ``device``."""
        self.features = torch.cat([f.to(device) for f in self.found])
        self.found = self.patches = None


@dataclass
class StepImages:
    """A step's model inputs (StepContext.model_inputs): features for its image tokens."""
    rows: torch.Tensor  # the step's token indices that take a feature
    features: torch.Tensor  # [rows, hidden]
    positions3: torch.Tensor  # [3, step tokens]
    # [step tokens]: the last key position each sees where past its own (an image token's
    # that attends both ways), else -1; None where no step token does (AttnMetadata)
    visible: torch.Tensor | None = None


def split(prompt):
    """(the prompt as text or ids, its images or None)."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = set(prompt) - PROMPT_KEYS
    if unknown:
        raise InvalidRequestError("prompt", f"unknown prompt keys {sorted(unknown)}; a prompt "
                                  f"dict takes {sorted(PROMPT_KEYS)}")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise InvalidRequestError("prompt", "a prompt dict takes one of prompt (text) and "
                                  "prompt_token_ids")
    data = prompt.get("multi_modal_data") or {}
    if set(data) - {"image"}:
        raise InvalidRequestError("multi_modal_data", f"only images are taken; got "
                                  f"{sorted(set(data) - {'image'})}")
    images = data.get("image")
    text = prompt["prompt"] if "prompt" in prompt else list(prompt["prompt_token_ids"])
    if isinstance(images, Pixels):
        return text, images
    if images is not None and not isinstance(images, (list, tuple)):
        images = [images]
    return text, list(images) if images else None


@dataclass
class Pixels:
    """A prompt's images as the model's image processor prepared them: per image its
    patches [patches, channels x patch volume] and their digest, or, for an image whose
    features the encoder cache held when it came in (known by its bytes: ``known``), None
    and the image as sent, prepared again only if they are gone by the time it is admitted."""
    patches: list  # each image's patches, or None
    grids: torch.Tensor  # [images, 3]: each one's (time, height, width) in patches
    keys: list[int]  # each image's digest of its prepared pixels
    sent: list  # each image as sent where its patches are None


def preprocess(model, images: list, fields: list[str] | None = None, known=None) -> Pixels:
    """The images decoded, checked and prepared by ``model``'s image processor (CPU work
    that grows with the pixels: a worker's reader thread runs it). ``fields``: what each
    image is called in an error (default multi_modal_data). ``known``: an EncoderCache,
    whose images (by their bytes) are not prepared again: a conversation's next turn."""
    fields = fields or ["multi_modal_data"] * len(images)
    if not hasattr(model, "encode_images"):
        raise InvalidRequestError(fields[0], f"{type(model).__name__} takes no images; send "
                                  "text only, or serve a vision-language model")
    if len(images) > MAX_IMAGES:
        raise InvalidRequestError(fields[MAX_IMAGES], f"{len(images)} images; at most "
                                  f"{MAX_IMAGES} a prompt")
    patches, grids, keys, sent = [], [], [], []
    for image, field in zip(images, fields):  # one at a time: a refusal names its image
        source = _source(image)
        seen = known.seen(source) if known is not None and source is not None else None
        if seen is not None:
            patches.append(None)
            grids.append(seen[0])
            keys.append(seen[1])
            sent.append(image)
            continue
        values, grid = _prepared(model, image, field)
        patches.append(values)
        grids.append(grid)
        keys.append(_digest(values))
        sent.append(None)
        if known is not None and source is not None:
            known.name(source, grid, keys[-1])
    return Pixels(patches, torch.cat(grids), keys, sent)


def _prepared(model, image, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixels, grid [1, 3]) of one image by the model's image processor."""
    picture = _picture(image, name)
    try:
        return model.image_inputs(picture)
    except ValueError as e:  # e.g. an aspect ratio past the processor's bound
        raise InvalidRequestError(name, f"cannot be prepared ({e})") from None


def _source(image) -> int | None:
    """An image's digest as sent (encoded bytes, or a PIL image's mode, size and pixels),
    or None for anything else (refused by name when it is prepared)."""
    from PIL import Image

    if isinstance(image, (bytes, bytearray)):
        data = bytes(image)
    elif isinstance(image, Image.Image):
        data = f"{image.mode} {image.size}".encode() + image.tobytes()
    else:
        return None
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"sent").digest(),
                          "little", signed=True)


def prepare(model, ids: list[int], images, cache=None) -> tuple[list[int], Images]:
    """The prompt's ids with each image token widened to its image's features, and the
    images (a list, or ``Pixels``) as the sequence carries them, with the features of
    those ``cache`` (an EncoderCache, core/encoder_cache.py) holds; the others are the
    ImageEncoder's to find."""
    pixels = images if isinstance(images, Pixels) else preprocess(model, images, known=cache)
    slots = [i for i, t in enumerate(ids) if t == model.image_token_id]
    if len(slots) != len(pixels.grids):
        raise InvalidRequestError("multi_modal_data", f"the prompt has {len(slots)} image "
                                  f"tokens (id {model.image_token_id}) for {len(pixels.grids)} "
                                  "images: one each")
    grids = pixels.grids
    counts = (grids.prod(-1) // model.merge ** 2).tolist()
    widened, last, spans = [], 0, []
    for slot, count in zip(slots, counts):
        widened += ids[last:slot]
        spans.append((len(widened), len(widened) + count))
        widened += [model.image_token_id] * count
        last = slot + 1
    widened += ids[last:]
    positions3, delta = model.image_positions(widened, grids)
    at = torch.tensor([i for i, t in enumerate(widened) if t == model.image_token_id])
    found = [cache.get(k) if cache is not None else None for k in pixels.keys]
    patches = [p if p is not None or f is not None else _prepared(model, image, "image")[0]
               for p, f, image in zip(pixels.patches, found, pixels.sent)]
    images = Images(at, positions3, delta, pixels.keys, counts, grids, patches, found,
                    spans=spans if getattr(model, "bidirectional_images", False) else [])
    if not images.missing():
        images.complete(model.embed_tokens.weight.device)
    return widened, images


def check_spans(images: Images, budget: int) -> None:
    """Refuses images a step could never take whole where their tokens attend both ways:
    a prompt chunk holds an image whole, and a step at most ``budget`` tokens."""
    longest = max((end - start for start, end in images.spans), default=0)
    if longest > budget:
        raise InvalidRequestError("multi_modal_data", f"an image of {longest} tokens, more "
                                  f"than a step's {budget} (max_num_batched_tokens): raise it "
                                  "to at least that")


def prompt_text(model, tokenizer, text: str) -> str:
    """A prompt's text with images as the family's processor writes it before tokenizing
    (Gemma 3's widens the chat template's image marker), else as it is."""
    hook = getattr(model, "prompt_text", None)
    return text if hook is None or tokenizer is None else hook(text, tokenizer)


def _digest(values: torch.Tensor) -> int:
    return int.from_bytes(hashlib.blake2b(values.float().numpy().tobytes(), digest_size=8,
                                          person=b"images").digest(), "little", signed=True)


def _picture(image, field: str):
    """A PIL image in RGB, from a PIL image or encoded bytes."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, (bytes, bytearray)):
        if len(image) > MAX_IMAGE_BYTES:
            raise InvalidRequestError(field, f"an image of {len(image):,} bytes; "
                                      f"at most {MAX_IMAGE_BYTES:,}: send it smaller", "too_long")
        try:
            with warnings.catch_warnings():  # a large size is refused by name below
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(image))  # reads the header: size, not pixels
            _check_size(image, field)
            image.load()
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
            raise InvalidRequestError(field, f"not a readable image ({e}); "
                                      "send PNG, JPEG or WebP bytes") from None
    if not isinstance(image, Image.Image):
        raise InvalidRequestError(field, f"an image must be a PIL image or "
                                  f"encoded bytes, not {type(image).__name__}")
    _check_size(image, field)
    return image.convert("RGB")


def _check_size(image, field: str) -> None:
    """Refuses an image of more than MAX_PIXELS pixels, before its pixels are decoded (a
    small file may declare a huge image)."""
    width, height = image.size
    if width * height > MAX_PIXELS:
        raise InvalidRequestError(field, f"an image of {width} x {height} "
                                  f"pixels; at most {MAX_PIXELS:,} pixels: resize it")


def step_inputs(seqs, num_tokens, device: torch.device):
    """The step's ``StepImages``, or None where no sequence of it computes tokens of an
    image prompt (past it, a sequence's positions are its offset on: ``shift_rows``)."""
    if all(seq.images is None or seq.num_computed >= seq.images.positions3.shape[1]
           for seq in seqs):
        return None
    rows, features, positions3, visible, t = [], [], [], [], 0
    for seq, n in zip(seqs, num_tokens):
        idx = torch.arange(seq.num_computed, seq.num_computed + n)
        images = seq.images
        visible.append(torch.full((n,), -1))
        for first, end in images.spans if images is not None else ():
            visible[-1][(idx >= first) & (idx < end)] = end - 1
        if images is None:
            positions3.append(idx.expand(3, -1))
        else:
            prompt = images.positions3.shape[1]
            past = idx.expand(3, -1) + images.delta
            positions3.append(torch.where(idx < prompt, images.positions3[
                :, idx.clamp(max=prompt - 1)], past))
            inside = (images.at >= idx[0]) & (images.at <= idx[-1])
            rows.append(images.at[inside] - idx[0] + t)
            features.append(images.features[inside])
        t += n
    visible = torch.cat(visible)
    return StepImages(torch.cat(rows).to(device), torch.cat(features).to(device),
                      torch.cat(positions3, dim=1).to(device),
                      visible.to(device, torch.int32) if bool((visible >= 0).any()) else None)


def shift_rows(shift: torch.Tensor, seqs) -> None:
    """Each of the step's sequences' position offset into its row of ``shift``: an image
    prompt's past it, else 0 (a row a text sequence had may go to an image one)."""
    rows = torch.tensor([seq.row for seq in seqs])
    offsets = torch.tensor([0 if seq.images is None else seq.images.delta for seq in seqs])
    shift[rows.to(shift.device)] = offsets.to(shift.device)


def bind(model: torch.nn.Module, rows: int, device: torch.device):
    """The position offsets of ``rows`` sequence rows, shared by the model's M-RoPE
    (zeros: text); None for a model without images."""
    if not hasattr(model, "encode_images"):
        return None
    shift = torch.zeros(rows, dtype=torch.long, device=device)
    for module in model.modules():
        if hasattr(module, "shift"):
            module.shift = shift
    return shift


def decided(cfg, model: torch.nn.Module):
    """``cfg`` with what a step with image inputs cannot run under turned off: a step that
    computes an image prompt's tokens runs eagerly (``Runner.launch``), decode steps in
    graphs; mixed graphs (a prompt chunk beside decodes) would need both."""
    if not hasattr(model, "encode_images"):
        return cfg
    return turned_off(cfg, f"{type(model).__name__} takes images",
                      {"mixed_graph_max_tokens": 0, "cpu_compiled_step": "off"})
