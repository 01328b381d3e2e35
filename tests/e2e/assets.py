"""Tiny real assets for the end-to-end GRPO runs, built offline: a byte-level BPE tokenizer with a ChatML chat
template, a tiny random Qwen3 saved from a config, a parquet dataset in verl's RL layout and a reward function file.

``python -m tests.e2e.assets OUT_DIR [--dtype bfloat16|float32]`` builds them (also used by scripts/gpu_e2e.sh).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["PROMPTS", "build_assets", "build_bench_assets", "REWARD_SOURCE", "BENCH_MODEL"]

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


#: The tests' model: a training step takes milliseconds.
TEST_MODEL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
#: The e2e benchmark's model (tests/e2e/bench.py): large enough that the actor phases of a step on ~350-token
#: prompts take seconds on two CPU cores (25M parameters besides the embeddings), so that they, not verl's fixed
#: per-phase costs (dispatch, data movement), dominate each phase's time.
BENCH_MODEL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64, max_position_embeddings=1024)


def build_model(out: Path, tokenizer, dtype: str = "bfloat16", seed: int = 0, dims: dict | None = None):
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|pad|>")
    cfg = Qwen3Config(vocab_size=512, **(dims or TEST_MODEL), tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=eos, pad_token_id=pad, rope_theta=10000.0)
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


# The benchmark's batch: every prompt is one shared instruction (a system message of about BENCH_SYSTEM_TOKENS
# tokens) plus a short question, so sharing=prompt deduplicates each question's rollouts and sharing=prefix also the
# instruction across questions.
_INSTRUCTION = (
    "You are a careful assistant for arithmetic, spelling and short factual questions. Read the question, think "
    "about what is asked, and answer with the result only: no explanation, no extra words, no punctuation unless "
    "the answer needs it. Numbers are written with digits. Words are written in lower case. When a question asks "
    "you to count, give the numbers separated by commas. When a question asks you to spell a word backwards, give "
    "the letters of the word in the reverse order as one word. When a question asks for a capital city, give the "
    "name of the city in one word. If you do not know the answer, give your best guess in the same form. "
    "Here are some examples of good answers. Add two and three: 5. Spell the word cat backwards: tac. What is the "
    "capital city of France: paris. Count from one to five: 1,2,3,4,5. The quick brown fox jumps over the lazy dog. "
)
BENCH_SYSTEM_TOKENS = 320
BENCH_QUESTIONS = [
    ("Add two and three.", "5"), ("Add one and four.", "5"), ("Add three and three.", "6"),
    ("Add four and five.", "9"), ("Add one and one, then add two.", "4"), ("Add five and zero.", "5"),
    ("Spell the word cat backwards.", "tac"), ("Spell the word dog backwards.", "god"),
    ("Spell the word fox backwards.", "xof"), ("Spell the word brown backwards, in lower case.", "nworb"),
    ("What is the capital city of France? Answer in one word.", "paris"),
    ("Count from one to five, separated by commas, and then say done.", "1,2,3,4,5 done"),
    ("Count from one to three.", "1,2,3"), ("Count from two to four.", "2,3,4"),
    ("Count from zero to five, separated by commas.", "0,1,2,3,4,5"), ("Count from five down to one.", "5,4,3,2,1"),
    ("What is two plus two?", "4"), ("What is three plus four? Answer with digits.", "7"),
    ("What is one plus zero?", "1"), ("Say the word done.", "done"), ("Say hello.", "hello"),
    ("How are you? Answer in one word.", "fine"), ("What is it? Say fox.", "fox"), ("Say thank you.", "thank you"),
]


def bench_instruction(tokenizer, tokens: int = BENCH_SYSTEM_TOKENS) -> str:
    """The shared instruction cut to about ``tokens`` tokens (whole words; the text repeats if it is too short)."""
    words = (_INSTRUCTION * (4 + tokens // 100)).split(" ")
    lo, hi = 1, len(words)
    while lo < hi:  # the fewest words that reach `tokens`
        mid = (lo + hi) // 2
        if len(tokenizer(" ".join(words[:mid]))["input_ids"]) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[:lo])


def build_bench_assets(out: str | Path, dtype: str = "bfloat16", system_tokens: int = BENCH_SYSTEM_TOKENS,
                       dims: dict | None = None) -> dict:
    """Assets of the e2e benchmark: the tokenizer, a random Qwen3 of ``dims`` (default :data:`BENCH_MODEL`; vocab:
    the tokenizer's 512) saved in ``dtype``, and a dataset of :data:`BENCH_QUESTIONS` behind one shared system
    instruction of about ``system_tokens`` tokens."""
    import pandas as pd

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out / "tokenizer")
    dims = dims or BENCH_MODEL
    build_model(out / "model", tok, dtype=dtype, dims=dims)
    system = bench_instruction(tok, system_tokens)
    msgs = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q, _ in BENCH_QUESTIONS]
    rows = [{"data_source": "zorro_bench", "prompt": m, "ability": "toy",
             "reward_model": {"style": "rule", "ground_truth": a}, "extra_info": {"split": "train", "index": i}}
            for i, (m, (_, a)) in enumerate(zip(msgs, BENCH_QUESTIONS))]
    pd.DataFrame(rows).to_parquet(out / "train.parquet")
    (out / "reward.py").write_text(REWARD_SOURCE)
    lens = [len(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))
            for m in msgs]
    info = {"model": str(out / "model"), "train": str(out / "train.parquet"), "reward": str(out / "reward.py"),
            "prompt_lengths": lens, "num_prompts": len(msgs), "dims": dims}
    (out / "assets.json").write_text(json.dumps(info, indent=1))
    return info


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = ap.parse_args()
    print(json.dumps(build_assets(a.out, a.dtype)))
