"""zorro_verl.testing: one import for every helper, and a light import (no transformers)."""

import subprocess
import sys

import torch

import zorro_verl.testing as testing

PUBLIC = ["create_dummy_batch", "tiny_config", "tiny_model", "HYBRID_KINDS", "tiny_hybrid_config",
          "tiny_hybrid_model", "exact_fp64_norms", "exact_fp64_hybrid", "ordinary_logprobs", "ordinary_logprobs_padded",
          "dense_mask", "dense_attention_oracle", "grads_of", "max_rel_grad_error", "grad_rel_error"]


def test_every_public_name_is_re_exported():
    assert set(PUBLIC) <= set(testing.__all__)
    for name in testing.__all__:
        assert getattr(testing, name) is not None, name


def test_import_does_not_import_transformers():
    code = ("import sys, zorro_verl.testing; "
            "bad = [m for m in ('transformers', 'verl') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_create_dummy_batch_layout():
    b = testing.create_dummy_batch(batch_size=5, num_unique_prompts=2, prompt_len=4, response_len=3, device="cpu",
                                   include_training_fields=True, add_padding=True, shuffle=True)
    assert {k: tuple(v.shape) for k, v in b.items()} == {
        "input_ids": (5, 7), "attention_mask": (5, 7), "position_ids": (5, 7), "responses": (5, 3),
        "response_mask": (5, 3), "old_log_probs": (5, 3), "advantages": (5, 3), "ref_log_prob": (5, 3)}
    assert b["input_ids"].dtype == torch.int64 and b["advantages"].dtype == torch.float32
