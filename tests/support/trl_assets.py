"""Tiny offline assets for the TRL tests: a byte-level BPE tokenizer with a ChatML template (trained here, no hub),
a tiny Qwen3 built from a config and saved in fp32, a toy conversational dataset and reward."""

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
