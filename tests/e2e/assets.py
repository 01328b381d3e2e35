"""Tiny real assets for the end-to-end GRPO runs, built offline: a byte-level BPE tokenizer with a ChatML chat
template, a tiny random Qwen3 saved from a config, a parquet dataset in verl's RL layout and a reward function file.

``python -m tests.e2e.assets OUT_DIR [--dtype bfloat16|float32]`` builds them (also used by scripts/gpu_e2e.sh).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["PROMPTS", "build_assets", "REWARD_SOURCE"]

# Distinct prompts of different lengths; the dataset holds exactly these, so with train_batch_size == len(PROMPTS)
# every step trains on all of them.
PROMPTS = [
    ("Add two and three.", "5"),
    ("What is the capital city of France? Answer in one word.", "Paris"),
    ("Spell the word cat backwards.", "tac"),
    ("Count from one to five, separated by commas, and then say done.", "1,2,3,4,5 done"),
]

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

# custom_reward_function.path: a score that varies between responses (the share of the ground truth's characters
# the response contains, plus a small length term), so GRPO advantages and gradients are not zero.
REWARD_SOURCE = '''\
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    chars = set(str(ground_truth).lower())
    text = str(solution_str).lower()
    hit = sum(1 for c in chars if c in text) / max(1, len(chars))
    return float(hit + 0.01 * (len(text) % 10))
'''

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Add two and three to get five. Numbers: 0 1 2 3 4 5 6 7 8 9, one two three four five.",
    "Paris is the capital city of France. Answer in one word, please.",
    "Spell the word cat backwards: tac. Count from one to five, separated by commas, and then say done.",
    "user assistant system: What is it? Hello! How are you? I am fine, thank you.",
]


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|pad|>", unk_token=None,
                                   additional_special_tokens=["<|endoftext|>", "<|im_start|>"])
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    return fast


def build_model(out: Path, tokenizer, dtype: str = "bfloat16", seed: int = 0):
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|pad|>")
    cfg = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos, pad_token_id=pad,
                      rope_theta=10000.0)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def build_dataset(out_file: Path):
    import pandas as pd

    rows = [{"data_source": "zorro_e2e", "prompt": [{"role": "user", "content": q}], "ability": "toy",
             "reward_model": {"style": "rule", "ground_truth": a}, "extra_info": {"split": "train", "index": i}}
            for i, (q, a) in enumerate(PROMPTS)]
    pd.DataFrame(rows).to_parquet(out_file)


def prompt_lengths(tokenizer) -> list[int]:
    """Token count of each dataset prompt after the chat template (what verl's dataset feeds the rollout)."""
    return [len(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)) for q, _ in PROMPTS]


def build_assets(out: str | Path, dtype: str = "bfloat16") -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out / "tokenizer")
    build_model(out / "model", tok, dtype=dtype)
    build_dataset(out / "train.parquet")
    (out / "reward.py").write_text(REWARD_SOURCE)
    lens = prompt_lengths(tok)
    info = {"model": str(out / "model"), "train": str(out / "train.parquet"), "reward": str(out / "reward.py"),
            "prompt_lengths": lens, "num_prompts": len(PROMPTS)}
    (out / "assets.json").write_text(json.dumps(info, indent=1))
    return info


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = ap.parse_args()
    print(json.dumps(build_assets(a.out, a.dtype)))
