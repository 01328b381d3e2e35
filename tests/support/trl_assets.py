"""Tiny offline assets for the TRL tests: a byte-level BPE tokenizer with a ChatML template (trained here, no hub),
a tiny Qwen3 built from a config and saved in fp32, a toy conversational dataset and reward; for image GRPO a tiny
Qwen2.5-VL, a processor for pre-patchified images and an image dataset."""

from __future__ import annotations

from pathlib import Path

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
_CORPUS = ["The quick brown fox jumps over the lazy dog.", "Add two and three to get five. 0 1 2 3 4 5 6 7 8 9",
           "Paris is the capital city of France. Answer in one word, please.",
           "Spell the word cat backwards: tac. Count from one to five, and then say done."]
#: Distinct prompts of different lengths (tokenised: about 10 to 30 tokens with the template).
PROMPTS = ["Add two and three.", "What is the capital city of France? Answer in one word.",
           "Spell the word cat backwards.", "Count from one to five, separated by commas, and then say done.",
           "The quick brown fox.", "Say done.", "Paris or France? Answer in one word, please.", "Numbers: 0 1 2 3"]


def build(out: Path, hidden: int = 64, layers: int = 2, vocab: int = 512):
    """Save tokenizer + model under ``out``; returns ``(out, tokenizer)``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS * 20, trainer=trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|pad|>",
                                   unk_token=None, additional_special_tokens=["<|endoftext|>", "<|im_start|>"])
    fast.chat_template = CHATML
    eos, pad = fast.convert_tokens_to_ids("<|im_end|>"), fast.convert_tokens_to_ids("<|pad|>")
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos, pad_token_id=pad,
                      rope_theta=10000.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).float()
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out, fast


def dataset(n_prompts: int = 4):
    """A conversational prompt dataset (TRL's ``prompt`` column)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS[:n_prompts]]})


def length_reward(completions, **kwargs):
    """A toy reward that varies between completions (their text lengths), so advantages are not zero."""
    out = []
    for c in completions:
        text = c[0]["content"] if isinstance(c, list) else c
        out.append(float(len(text) % 7) / 7.0)
    return out


# ---------------------------------------------------------------- image GRPO (a tiny Qwen2.5-VL)
#: The vision tokens of the VLM tokenizer (Qwen-VL's names: TRL and the processor look them up by name).
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
#: ChatML with Qwen-VL's image block for ``{"type": "image"}`` content (one ``<|image_pad|>`` per image; the
#: processor expands it to the image's placeholder count).
VL_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
               "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
               "{% for c in message['content'] %}{% if c['type'] == 'image' %}"
               "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% elif c['type'] == 'text' %}{{ c['text'] }}"
               "{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
#: Images of the VLM dataset: pre-patchified (Qwen2-VL's patch rows, 96 values each: 3 channels x temporal 2 x
#: 4 x 4), grid (1, 4, 4) patches -> 16 patch rows, 4 placeholders after the 2 x 2 merge.
IMAGE_GRID = (1, 4, 4)


class _ImageProcessor:
    """The part of an image processor TRL reads (``merge_size``)."""

    merge_size = 2


def _patches(img):
    """A dataset image (1536 floats) -> its patch rows ``[16, 96] float32``."""
    import torch

    return torch.as_tensor(img, dtype=torch.float32).reshape(-1, 96)


def vlm_processor(tokenizer):
    """A Qwen2.5-VL-style processor for pre-patchified images (the real image processor needs torchvision and PIL,
    which the TRL environment does not install): ``processor(text=, images=)`` and ``apply_chat_template`` return
    what Qwen2.5-VL's return — ``input_ids`` with each ``<|image_pad|>`` expanded to the image's placeholders,
    ``attention_mask``, ``pixel_values [sum rows, 96]``, ``image_grid_thw [n, 3]``, ``mm_token_type_ids``."""
    import torch
    from transformers import BatchFeature, ProcessorMixin

    pad_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    n_tok = IMAGE_GRID[0] * IMAGE_GRID[1] * IMAGE_GRID[2] // 4

    class Processor(ProcessorMixin):
        def __init__(self):  # no ProcessorMixin.__init__: nothing to load
            self.tokenizer = tokenizer
            self.image_processor = _ImageProcessor()
            self.chat_template = VL_TEMPLATE

        def __call__(self, text=None, images=None, padding=True, return_tensors="pt", padding_side="left",
                     **kwargs):
            text = [text] if isinstance(text, str) else list(text)
            flat = [img for row in (images or []) if row for img in row]
            text = [t.replace("<|image_pad|>", "<|image_pad|>" * n_tok) for t in text]
            enc = tokenizer(text, padding=padding, padding_side=padding_side, return_tensors=return_tensors,
                            add_special_tokens=False)
            out = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
            if flat:
                out["pixel_values"] = torch.cat([_patches(img) for img in flat])
                out["image_grid_thw"] = torch.tensor([IMAGE_GRID] * len(flat))
            ids = enc["input_ids"]
            out["mm_token_type_ids"] = ((ids == pad_id).to(torch.int32) if isinstance(ids, torch.Tensor)
                                        else [[int(t == pad_id) for t in row] for row in ids])
            return BatchFeature(out)

        def apply_chat_template(self, conversation, tokenize=False, return_dict=False, add_generation_prompt=False,
                                tools=None, chat_template=None, continue_final_message=False, **kwargs):
            batched = isinstance(conversation[0], list)
            convs = conversation if batched else [conversation]
            texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                   chat_template=chat_template or VL_TEMPLATE,
                                                   continue_final_message=continue_final_message) for c in convs]
            if not tokenize:
                return texts if batched else texts[0]
            images = [[p["image"] for m in c if isinstance(m.get("content"), list) for p in m["content"]
                       if p.get("type") == "image"] for c in convs]
            enc = self(text=texts, images=images, padding=False, return_tensors=None)
            ids = [list(x) for x in enc["input_ids"]]
            if not return_dict:
                return ids
            out = {k: v for k, v in enc.items() if k not in ("input_ids", "mm_token_type_ids")}
            out["input_ids"] = ids
            return out

        def batch_decode(self, *args, **kwargs):
            return tokenizer.batch_decode(*args, **kwargs)

        def decode(self, *args, **kwargs):
            return tokenizer.decode(*args, **kwargs)

    return Processor()


def build_vlm(out: Path):
    """A tiny fp32 Qwen2.5-VL (zorro's tiny config with this tokenizer's vocabulary and vision token ids) saved under
    ``out`` with the tokenizer; returns ``(out, processor)``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForImageTextToText, GenerationConfig, PreTrainedTokenizerFast

    from zorro_verl.testing.vlm import tiny_vlm_config

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS * 20, trainer=trainers.BpeTrainer(
        vocab_size=512, special_tokens=SPECIALS + VISION_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|pad|>",
                                   unk_token=None,
                                   additional_special_tokens=["<|endoftext|>", "<|im_start|>"] + VISION_TOKENS)
    fast.chat_template = VL_TEMPLATE
    tid = fast.convert_tokens_to_ids
    eos, pad = tid("<|im_end|>"), tid("<|pad|>")
    cfg = tiny_vlm_config("qwen2_5_vl")
    cfg.text_config.vocab_size = 512
    cfg.image_token_id, cfg.video_token_id = tid("<|image_pad|>"), tid("<|video_pad|>")
    cfg.vision_start_token_id, cfg.vision_end_token_id = tid("<|vision_start|>"), tid("<|vision_end|>")
    cfg.text_config.eos_token_id = cfg.eos_token_id = eos
    cfg.text_config.pad_token_id = cfg.pad_token_id = pad
    cfg.text_config.bos_token_id = cfg.bos_token_id = None
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out, vlm_processor(fast)


def vlm_dataset(n_prompts: int = 4):
    """A conversational dataset with one image per prompt (``image``: a pre-patchified image, 1536 floats); prompts
    1 and 0 share text (different images), prompt 3 reuses prompt 0's image."""
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    imgs = [torch.randn(16 * 96, generator=g).tolist() for _ in range(3)]
    texts = [PROMPTS[0], PROMPTS[0], PROMPTS[2], PROMPTS[5]]
    images = [imgs[0], imgs[1], imgs[2], imgs[0]]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": t}] for t in texts[:n_prompts]],
                              "image": images[:n_prompts]})
