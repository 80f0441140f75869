"""A stochastic block model graph with class-dependent features: real-shaped node
classification data that needs no download (the fallback when Planetoid is absent)."""

from __future__ import annotations

import torch


def stochastic_block_graph(
    num_nodes: int = 600,
    num_classes: int = 4,
    num_features: int = 32,
    p_in: float = 0.03,
    p_out: float = 0.003,
    noise: float = 2.0,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A symmetric SBM graph: ``x, y, edge_index, train_mask, val_mask, test_mask``.

    Features are a class mean plus Gaussian noise strong enough that a vertex's own features
    alone classify it poorly, so aggregating neighbours helps (as in citation graphs). Masks
    follow Planetoid's split: 20 training vertices per class (fewer in tiny graphs), 20%
    validation, the rest test.

    Args:
        num_nodes: vertices.
        num_classes: blocks (= classes).
        num_features: feature width.
        p_in: edge probability inside a block.
        p_out: edge probability across blocks.
        noise: feature noise standard deviation (class means are unit Gaussians).
        seed: RNG seed.

    Example:
        >>> g = stochastic_block_graph(200, 4, seed=1)
        >>> g["x"].shape, int(g["train_mask"].sum())
        (torch.Size([200, 32]), 80)
    """
    generator = torch.Generator().manual_seed(seed)
    y = torch.arange(num_nodes) % num_classes
    y = y[torch.randperm(num_nodes, generator=generator)]
    same = y[:, None] == y[None, :]
    prob = torch.where(same, torch.tensor(p_in), torch.tensor(p_out))
    upper = torch.triu(torch.rand(num_nodes, num_nodes, generator=generator) < prob, diagonal=1)
    src, dst = torch.nonzero(upper, as_tuple=True)
    edge_index = torch.cat([torch.stack([src, dst]), torch.stack([dst, src])], dim=1)
    means = torch.randn(num_classes, num_features, generator=generator)
    x = means[y] + noise * torch.randn(num_nodes, num_features, generator=generator)
    order = torch.randperm(num_nodes, generator=generator)
    train_mask = torch.zeros(num_nodes, dtype=torch.bool)
    for label in range(num_classes):
        members = order[y[order] == label]
        train_mask[members[: min(20, max(1, members.numel() // 5))]] = True
    rest = order[~train_mask[order]]
    val_mask = torch.zeros(num_nodes, dtype=torch.bool)
    val_mask[rest[: num_nodes // 5]] = True
    test_mask = ~(train_mask | val_mask)
    return {"x": x, "y": y, "edge_index": edge_index, "train_mask": train_mask,
            "val_mask": val_mask, "test_mask": test_mask}  # fmt: skip
