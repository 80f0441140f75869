"""stalwart.flat: a module's parameters or gradients as one vector, and back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stalwart.errors import ConfigurationError
from stalwart.flat import flatten, flatten_grads, unflatten_grads, unflatten_into


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def test_parameters_round_trip_in_place():
    source, target = _model(0), _model(1)
    storage = [p.data_ptr() for p in target.parameters()]
    vector = flatten(source.parameters())
    assert vector.dtype == torch.float32 and not vector.requires_grad
    assert vector.numel() == sum(p.numel() for p in source.parameters())
    assert torch.equal(vector, nn.utils.parameters_to_vector(source.parameters()).detach())
    unflatten_into(target.parameters(), vector)
    for a, b in zip(source.parameters(), target.parameters(), strict=True):
        assert torch.equal(a, b)
    assert [p.data_ptr() for p in target.parameters()] == storage  # in place
    vector.add_(1.0)  # nothing aliases the vector afterwards
    assert torch.equal(next(target.parameters()), next(source.parameters()))


def test_flatten_casts_and_copies():
    tensors = [
        torch.arange(4, dtype=torch.float64).reshape(2, 2),
        torch.ones(3, dtype=torch.float64),
    ]
    vector = flatten(tensors)
    assert vector.dtype == torch.float32
    assert vector.tolist() == [0.0, 1.0, 2.0, 3.0, 1.0, 1.0, 1.0]
    assert flatten(tensors, dtype=torch.float64).dtype == torch.float64


def test_grads_round_trip_and_missing_grads_are_zeros():
    model = _model(0)
    model(torch.randn(5, 3))[:, 0].sum().backward()
    first, *_ = model.parameters()
    first.grad = None  # a parameter the step did not reach
    vector = flatten_grads(model.parameters())
    assert torch.count_nonzero(vector[: first.numel()]) == 0
    expected = [torch.zeros_like(first)] + [p.grad.clone() for p in list(model.parameters())[1:]]

    other = _model(1)
    unflatten_grads(other.parameters(), vector)
    for param, grad in zip(other.parameters(), expected, strict=True):
        assert torch.equal(param.grad, grad)
    vector.zero_()  # the grads are copies
    assert any(torch.count_nonzero(p.grad) for p in other.parameters())


def test_sparse_grads_are_made_dense():
    sparse, dense = nn.Embedding(4, 2, sparse=True), nn.Embedding(4, 2)
    dense.load_state_dict(sparse.state_dict())
    rows = torch.tensor([1, 3, 1])  # row 1 twice: an uncoalesced sparse gradient sums both
    for embedding in (sparse, dense):
        (embedding(rows) * torch.arange(6.0).reshape(3, 2)).sum().backward()
    assert sparse.weight.grad.is_sparse
    vector = flatten_grads(sparse.parameters())
    assert torch.equal(vector, flatten_grads(dense.parameters()))
    assert vector.tolist() == [0.0, 0.0, 4.0, 6.0, 0.0, 0.0, 2.0, 3.0]


def test_a_vector_of_the_wrong_length_is_refused():
    model = _model(0)
    vector = flatten(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigurationError, match="does not fit"):
        unflatten_into(model.parameters(), vector[:-1])
    with pytest.raises(ConfigurationError, match="different model"):
        unflatten_grads(model.parameters(), torch.cat([vector, vector[:1]]))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
