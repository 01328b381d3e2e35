"""Gradient collection and error measures of zorro_verl.testing."""

import pytest
import torch

from zorro_verl.testing import grad_rel_error, grads_of, max_rel_grad_error


def test_grads_of_clones_present_grads_only():
    lin = torch.nn.Linear(3, 2)
    lin.bias.requires_grad_(False)
    lin(torch.ones(1, 3)).sum().backward()
    g = grads_of(lin)
    assert list(g) == ["weight"] and torch.equal(g["weight"], torch.ones(2, 3))
    lin.weight.grad.zero_()
    assert torch.equal(g["weight"], torch.ones(2, 3))  # a copy, not the live .grad


def test_max_rel_grad_error_is_per_tensor():
    ref = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([1e-3, 0.0])}
    got = {"a": torch.tensor([1.0, -2.1]), "b": torch.tensor([1e-3, 1e-4])}
    err, name = max_rel_grad_error(ref, got)
    assert name == "b" and err == pytest.approx(0.1)  # 1e-4 / 1e-3, measured against b's own scale
    assert max_rel_grad_error(ref, ref) == (0.0, "")


def test_max_rel_grad_error_floor_and_missing():
    zero = {"z": torch.zeros(2, dtype=torch.float64)}
    err, _ = max_rel_grad_error(zero, {"z": torch.full((2,), 1e-20, dtype=torch.float64)})
    assert err == pytest.approx(1e-20 / torch.finfo(torch.float64).eps)  # default floor: dtype eps
    err, _ = max_rel_grad_error(zero, {"z": torch.full((2,), 1e-3, dtype=torch.float64)}, floor=1.0)
    assert err == pytest.approx(1e-3)
    with pytest.raises(AssertionError, match="only one model"):
        max_rel_grad_error(zero, {"y": torch.zeros(2)})


def test_grad_rel_error_is_global():
    a = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([1e-3, 0.0])}
    b = {"a": torch.tensor([1.0, -2.1]), "b": torch.tensor([1e-3, 1e-4])}
    assert grad_rel_error(a, b) == pytest.approx(0.1 / 2.0)  # largest difference over the largest gradient
    assert grad_rel_error(a, a) == 0.0


def test_grad_rel_error_refuses_different_or_empty_sets():
    with pytest.raises(ValueError, match="same non-empty set"):
        grad_rel_error({"a": torch.ones(1)}, {"b": torch.ones(1)})
    with pytest.raises(ValueError, match="same non-empty set"):
        grad_rel_error({}, {})
