"""Flat vectors of a module's parameters or gradients, and back.

What goes over a wire (the parameter server's weights and gradients, the pipeline's gradient
all-reduce, the GNN's weight gradients) is one contiguous vector, in the order
``module.parameters()`` yields. torch's own ``parameters_to_vector`` covers the simple case; these
add what the callers need on top: a float32 copy detached from autograd, gradients that may be
``None`` (a parameter the step did not reach counts as zero), and a length check on the way back.

Example::

    from stalwart.flat import flatten, unflatten_into

    vector = flatten(model.parameters())
    unflatten_into(other_model.parameters(), vector)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from stalwart.errors import ConfigurationError


def flatten(tensors: Iterable[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One flat ``dtype`` vector of ``tensors``, a copy detached from autograd."""
    return torch.cat([t.detach().reshape(-1) for t in tensors]).to(dtype)


def flatten_grads(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """One flat vector of the parameters' gradients; a missing gradient counts as zeros, and a
    sparse one (``nn.Embedding(sparse=True)``) is made dense."""
    return torch.cat([_dense_grad(p).detach().reshape(-1) for p in parameters])


def _dense_grad(parameter: torch.nn.Parameter) -> torch.Tensor:
    grad = parameter.grad
    if grad is None:
        return torch.zeros_like(parameter)
    # A sparse gradient cannot be reshaped, and what goes over the wire is one dense vector
    # anyway; to_dense also sums the repeated rows of an uncoalesced gradient.
    return grad.to_dense() if grad.layout != torch.strided else grad


def _check_length(parameters: list[torch.Tensor], vector: torch.Tensor) -> None:
    expected = sum(p.numel() for p in parameters)
    if vector.numel() != expected:
        raise ConfigurationError(
            f"a flat vector of {vector.numel()} values does not fit {expected} parameters; "
            "was it made from a different model?"
        )


def unflatten_into(parameters: Iterable[torch.Tensor], vector: torch.Tensor) -> None:
    """Copy ``vector`` into ``parameters`` in place (nothing aliases ``vector`` afterwards)."""
    parameters = list(parameters)
    _check_length(parameters, vector)
    offset = 0
    with torch.no_grad():
        for p in parameters:  # in place: optimizers and tied weights keep their storage
            p.copy_(vector[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def unflatten_grads(parameters: Iterable[torch.nn.Parameter], vector: torch.Tensor) -> None:
    """Set each parameter's ``.grad`` to its slice of ``vector`` (copies)."""
    parameters = list(parameters)
    _check_length(parameters, vector)
    offset = 0
    for p in parameters:
        p.grad = vector[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
