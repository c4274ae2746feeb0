"""Random-weight Qwen2-VL / Qwen2.5-VL models with a processor built on this machine (no hub): the
vision-language example, the benchmarks at real shapes and the tests use them.

The processor is a ``VisionProcessor`` over transformers' PIL image processor (no torchvision) and a
byte-level BPE tokenizer trained with ``tokenizers`` on generated lines, with Qwen's vision special
tokens and a ChatML template that renders ``{"type": "image"}`` items as
``<|vision_start|><|image_pad|><|vision_end|>``. ``save(path)`` writes an HF folder that
``AutoModelForImageTextToText`` and ``VisionProcessor.from_pretrained`` (``AutoProcessor`` where
torchvision is installed) load.

    model, processor = build("qwen2_vl")                       # tiny: ~0.2M parameters
    model, processor = build("qwen2_5_vl", **SHAPES["3b"])     # Qwen2.5-VL-3B's shape
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Dict, List, Tuple, Union

import torch

from verl_fast.models.vision_processor import VisionProcessor

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                  "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# a 28 x 28 pixel tile is one token (patches of 14 pixels merged 2 x 2): images of 4 to 16 tokens
MIN_PIXELS, MAX_PIXELS = 4 * 28 * 28, 16 * 28 * 28
# language model and vision tower sizes (the 3B row: Qwen2.5-VL-3B-Instruct's config)
SHAPES: Dict[str, Dict[str, int]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1, vision_depth=2,
                 vision_dim=32, vision_heads=2, vision_intermediate=64),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_layers=36, num_heads=16, num_kv_heads=2,
               vision_depth=32, vision_dim=1280, vision_heads=16, vision_intermediate=3420),
}
# the weights' standard deviation: the 3B's is Qwen2.5-VL-3B's own. Wider draws grow its 36-layer stream until
# bf16 rounding decides which keys attention picks: two bf16 forwards of the same weights (the decode's, the
# update's) then give different log-probs, and the guardrails' sync check rightly stops the run. The tiny model's
# wider draw keeps its samples varied.
INITIALIZER_RANGE = {"tiny": 0.1, "3b": 0.02}


def corpus(num_lines: int = 400, seed: int = 0) -> List[str]:
    """Counting questions, numbers and short sentences: what the example and tests ask and answer."""
    rng = random.Random(seed)
    words = ["how", "many", "red", "squares", "are", "there", "in", "the", "image", "answer", "with", "a",
             "number", "count", "what", "is", "shape", "color", "blue", "one", "two", "three", "and", "of"]
    return [f"{rng.randint(0, 99)} " + " ".join(rng.choices(words, k=rng.randint(3, 10))) for _ in range(num_lines)]


def build_tokenizer(vocab_size: int = 512, seed: int = 0):
    """A ``PreTrainedTokenizerFast``: byte-level BPE, the vision tokens, the chat template, EOS = pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, bos_token=None,
                                   unk_token=None, additional_special_tokens=SPECIAL_TOKENS[3:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_processor(vocab_size: int = 512, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> VisionProcessor:
    from transformers import Qwen2VLImageProcessorPil

    images = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    return VisionProcessor(images, build_tokenizer(vocab_size), CHAT_TEMPLATE)


def _mrope_section(head_dim: int) -> List[int]:
    """M-RoPE's (t, h, w) split of the head's rotary pairs, in Qwen's 2 : 3 : 3 proportion (16/24/24 at 128)."""
    pairs = head_dim // 2
    hw = 3 * pairs // 8
    return [pairs - 2 * hw, hw, hw]


def build_config(family: str, tokenizer: Any, shape: str = "tiny", tie_word_embeddings: bool = False):
    """A Qwen2-VL / Qwen2.5-VL config of ``SHAPES[shape]`` over ``tokenizer``'s vocabulary and tokens."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    s = SHAPES[shape]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    eos = tokenizer.eos_token_id
    head_dim = s["hidden_size"] // s["num_heads"]
    text = dict(vocab_size=len(tokenizer), hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"],
                num_key_value_heads=s["num_kv_heads"], max_position_embeddings=4096, initializer_range=INITIALIZER_RANGE[shape],
                eos_token_id=eos, pad_token_id=eos, bos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": _mrope_section(head_dim)})
    if family == "qwen2_vl":
        vision = dict(depth=s["vision_depth"], embed_dim=s["vision_dim"], hidden_size=s["hidden_size"],
                      num_heads=s["vision_heads"], mlp_ratio=s["vision_intermediate"] // s["vision_dim"])
        cls = transformers.Qwen2VLConfig
    else:
        vision = dict(depth=s["vision_depth"], hidden_size=s["vision_dim"], intermediate_size=s["vision_intermediate"],
                      num_heads=s["vision_heads"], out_hidden_size=s["hidden_size"], window_size=112,
                      fullatt_block_indexes=list(range(s["vision_depth"] // 4 - 1, s["vision_depth"], s["vision_depth"] // 4)
                                                 if s["vision_depth"] >= 4 else [s["vision_depth"] - 1]))
        cls = transformers.Qwen2_5_VLConfig
    return cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
               video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
               vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=tie_word_embeddings)


def build(family: str = "qwen2_vl", shape: str = "tiny", seed: int = 0, vocab_size: int = 512,
          dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu") -> Tuple[Any, VisionProcessor]:
    """``(model, processor)``: a random-weight VLM in eval mode (its generation config's EOS and pad set),
    its weights drawn on ``device`` (a large model's draw is far quicker on a GPU than on the CPU)."""
    import transformers

    processor = build_processor(vocab_size)
    config = build_config(family, processor.tokenizer, shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForImageTextToText.from_config(config, dtype=dtype).eval()
    model.generation_config.eos_token_id = processor.tokenizer.eos_token_id
    model.generation_config.pad_token_id = processor.tokenizer.eos_token_id
    return model, processor


def save(path: Union[str, Path], family: str = "qwen2_vl", shape: str = "tiny", seed: int = 0,
         device: Union[str, torch.device] = "cpu") -> Path:
    """Model and processor saved as one HF folder at ``path`` (the weights drawn on ``device``); returns the path."""
    path = Path(path)
    model, processor = build(family, shape, seed, device=device)
    model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(str(path))
    return path
