"""Prompts with images: verl's and TRL's formats, resize bounds, bad images refused naming the row."""

import io

import pytest
import torch

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from tiny_vlm import MAX_PIXELS, build_processor, square_image  # noqa: E402
from verl_fast.data import RLDataProcessor  # noqa: E402
from verl_fast.data.images import ImageLimits, read_image, vision_messages  # noqa: E402


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def processor():
    return build_processor()


def _tokens_per_image(grid: torch.Tensor) -> list:
    return [int(g.prod()) // 4 for g in grid]  # merge 2 x 2


def test_verl_row_bytes_paths_and_dicts(processor, tmp_path):
    """verl's row: <image> placeholders in the text, an images column of bytes / a path / a dict."""
    first, second = square_image(1, 56), square_image(3, 112, seed=1)
    path = tmp_path / "b.png"
    second.save(path)
    data = RLDataProcessor(processor, max_prompt_length=512)
    for images in ([_png(first), str(path)], [{"bytes": _png(first), "path": None}, {"bytes": None, "path": str(path)}],
                   [first, second]):
        row = {"prompt": [{"role": "user", "content": "<image>and<image> count"}], "images": images,
               "data_source": "x", "reward_model": {"ground_truth": "1"}}
        p = data.encode(row)
        assert p.vision.num_images == 2
        pad = processor.image_token_id
        counts = _tokens_per_image(p.vision.image_grid_thw)
        assert p.prompt_ids.count(pad) == sum(counts)
        # each image's tokens form one run, between the vision start and end tokens, in the order given
        start = processor.convert_tokens_to_ids("<|vision_start|>")
        runs = [i for i, t in enumerate(p.prompt_ids) if t == start]
        for k, at in enumerate(runs):
            assert p.prompt_ids[at + 1 : at + 1 + counts[k]] == [pad] * counts[k]
            assert p.prompt_ids[at + 1 + counts[k]] == processor.convert_tokens_to_ids("<|vision_end|>")
        assert p.vision.pixel_values.shape[0] == int(p.vision.image_grid_thw.prod(-1).sum())
        assert all(im.mode == "RGB" for im in p.vision.images)
        assert p.prompt_text.count("<|image_pad|>") == 2  # the log's text: one placeholder an image


def test_trl_rows_image_and_images(processor):
    """TRL's rows: a conversational prompt with image items (images column), or plain text with an
    image column (the image opens the first user turn)."""
    data = RLDataProcessor(processor, max_prompt_length=512)
    im = square_image(2)
    row = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}],
           "images": [im]}
    a = data.encode(row)
    b = data.encode({"prompt": "How many?", "image": im})
    c = data.encode({"prompt": [{"role": "user", "content": "<image>How many?"}], "images": [_png(im)]})
    assert a.prompt_ids == b.prompt_ids == c.prompt_ids
    assert torch.equal(a.vision.pixel_values, c.vision.pixel_values)


def test_placeholders_must_match_images():
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        vision_messages([{"role": "user", "content": "<image><image>x"}], 1)


def test_resize_bounds_from_limits():
    """trainer.image_min_pixels / image_max_pixels: a large picture's token count follows the bound."""
    big = square_image(2, 448)
    counts = []
    for max_pixels in (16 * 784, 64 * 784):
        data = RLDataProcessor(build_processor(), max_prompt_length=2048,
                               image_limits=ImageLimits(max_pixels=max_pixels))
        p = data.encode({"prompt": "n?", "image": big})
        counts.append(int(p.vision.image_grid_thw.prod()) // 4)
        assert counts[-1] <= max_pixels // 784
    assert counts[0] < counts[1]
    tiny = square_image(1, 20)
    data = RLDataProcessor(build_processor(), image_limits=ImageLimits(min_pixels=16 * 784, max_pixels=MAX_PIXELS))
    assert int(data.encode({"prompt": "n?", "image": tiny}).vision.image_grid_thw.prod()) // 4 >= 16


def test_bad_images_name_the_row(processor, tmp_path):
    """Unreadable bytes, a missing file, a huge picture, a 16-bit depth map: one line naming file:line."""
    good = _png(square_image(1))
    truncated = good[: len(good) // 2]
    depth = Image.new("I;16", (32, 32))
    cases = [
        (b"not an image", "cannot read the image"),
        (str(tmp_path / "missing.png"), "not found"),
        (depth, "not a picture"),
        (truncated, "cannot"),
    ]
    import json

    for value, message in cases:
        path = tmp_path / "rows.jsonl"
        bad = value if isinstance(value, (str,)) else None
        with open(path, "w") as f:
            f.write(json.dumps({"prompt": "a", "data_source": "x"}) + "\n")
            f.write(json.dumps({"prompt": "<image>b", "images": [bad or "PLACEHOLDER"], "data_source": "x"}) + "\n")
        data = RLDataProcessor(processor)
        rows = data.load(str(path))
        if bad is None:
            rows[1]["images"] = [value]
        with pytest.raises(ValueError) as e:
            data.encode_all(rows)
        text = str(e.value)
        assert "\n" not in text and message in text and "images[0]" in text and "rows.jsonl:2" in text, text
    huge = square_image(1, 200)
    with pytest.raises(ValueError, match="larger than trainer.image_max_input_pixels=1000"):
        read_image(huge, ImageLimits(max_input_pixels=1000))


def test_modes_converted_to_rgb():
    for mode in ("RGBA", "L", "P", "1", "CMYK"):
        assert read_image(Image.new(mode, (8, 8))).mode == "RGB"


def test_images_without_vision_processor():
    from tiny_models import build_tokenizer

    data = RLDataProcessor(build_tokenizer())
    with pytest.raises(ValueError, match="row 0: the row has images, but the tokenizer is not a vision-language"):
        data.encode_all([{"prompt": "<image>x", "images": [square_image(1)]}])


def test_placeholder_without_images_refused(processor):
    data = RLDataProcessor(processor)
    with pytest.raises(ValueError, match=r"row 0: the prompt holds <\|image_pad\|>, but the row has no images"):
        data.encode_all([{"prompt": "look: <|image_pad|>"}])
