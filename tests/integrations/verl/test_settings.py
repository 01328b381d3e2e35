"""The verl-free ``zorro`` settings shared by both verl generations (runs without verl)."""

import pytest

from zorro_verl.integrations.verl.settings import ZorroSettings, resolve_attention_backend


def test_settings_defaults_and_mapping():
    s = ZorroSettings.from_mapping({})
    assert s.to_dict() == {"enable": False, "rollout_n": None, "logits_optimization": "none",
                           "attention_backend": "auto", "on_unsupported": "raise", "group_balance": True,
                           "group_balance_mode": "keep_minibatches", "sharing": "prompt", "min_shared_len": 64}
    assert s.plan_kwargs() == {"sharing": "prompt"}
    t = ZorroSettings.from_mapping({"sharing": "prefix", "min_shared_len": 16})
    assert t.plan_kwargs() == {"sharing": "prefix", "min_shared_len": 16}
    s = ZorroSettings.from_mapping({"_target_": "x.Y", "enable": True, "rollout_n": 8,
                                    "logits_optimization": "memory", "on_unsupported": "warn"})
    assert s.enable and s.rollout_n == 8 and s.logits_optimization == "memory" and s.on_unsupported == "warn"


@pytest.mark.parametrize("bad, key", [
    ({"enabel": True}, "unknown key"),
    ({"enable": "yes"}, "zorro.enable"),
    ({"rollout_n": 0}, "zorro.rollout_n"),
    ({"rollout_n": True}, "zorro.rollout_n"),
    ({"logits_optimization": "fast"}, "zorro.logits_optimization"),
    ({"attention_backend": "flash_attention_2"}, "zorro.attention_backend"),
    ({"on_unsupported": "ignore"}, "zorro.on_unsupported"),
    ({"group_balance": 1}, "zorro.group_balance"),
    ({"group_balance_mode": "whole"}, "zorro.group_balance_mode"),
    ({"sharing": "tree"}, "zorro.sharing"),
    ({"min_shared_len": 0}, "zorro.min_shared_len"),
    ({"min_shared_len": "64"}, "zorro.min_shared_len"),
])
def test_settings_reject(bad, key):
    with pytest.raises(ValueError, match=key):
        ZorroSettings.from_mapping(bad)


def test_settings_omegaconf_if_available():
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"n": 4, "z": {"enable": True, "rollout_n": "${n}"}})
    assert ZorroSettings.from_mapping(cfg.z).rollout_n == 4


def test_resolve_backend():
    assert resolve_attention_backend("auto", "cpu") == "flash_copyfree"
    assert resolve_attention_backend("eager", "cpu") == "eager"
    assert resolve_attention_backend("standard", "cpu") == "standard"
    assert resolve_attention_backend("flash_copyfree", "cpu") == "flash_copyfree"  # PyTorch's CPU flash kernels
    for name in ("flash", "flex"):  # cannot train on this CPU host: refused, naming the backend
        with pytest.raises(ValueError, match=name):
            resolve_attention_backend(name, "cpu")


def test_resolve_backend_on_cuda_follows_the_memory_rule(monkeypatch, caplog):
    """CUDA: ``auto`` -> ``flash_copyfree`` wherever flash kernels exist (either provider: forced here through
    ``ZORRO_FLASH_PROVIDER``, the switch users have); ``flash`` stays an explicit choice; without flash kernels
    ``sdpa``, with one warning that says it may hold more memory than stock's attention."""
    from zorro_verl.attention.primitives import flash_provider
    from zorro_verl.integrations.verl import settings

    for provider in ("torch", "flash_attn"):
        monkeypatch.setenv("ZORRO_FLASH_PROVIDER", provider)
        assert resolve_attention_backend("auto", "cuda") == "flash_copyfree"
        assert resolve_attention_backend("flash", "cuda") == "flash"
        assert resolve_attention_backend("auto", "cpu") == "flash_copyfree"
    monkeypatch.delenv("ZORRO_FLASH_PROVIDER")
    if flash_provider() is not None:
        pytest.skip("flash kernels are installed here: the no-kernel CUDA fallback cannot be reached")
    monkeypatch.setattr(settings, "_logged_auto_sdpa", False)
    with caplog.at_level("WARNING", logger=settings.__name__):
        assert [resolve_attention_backend("auto", "cuda") for _ in range(2)] == ["sdpa", "sdpa"]
    warned = [r.getMessage() for r in caplog.records if "attention_backend=auto picked 'sdpa'" in r.getMessage()]
    assert len(warned) == 1 and "more memory than stock's" in warned[0] and "flash_copyfree" in warned[0]


def test_every_registered_backend_is_a_valid_choice():
    from zorro_verl.attention import BACKEND_NAMES

    for name in BACKEND_NAMES:
        assert ZorroSettings.from_mapping({"attention_backend": name}).attention_backend == name
