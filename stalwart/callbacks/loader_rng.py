"""The random state of generators that the training DataLoaders own.

PyTorch's reproducibility notes recommend ``DataLoader(..., generator=g)`` with a seeded ``g``.
Such a generator is not the global torch generator: it shuffles (``RandomSampler`` draws each
epoch's permutation from it) and seeds the loader's worker processes (each epoch's iterator draws
its base seed from it), and it moves on from epoch to epoch. A resume or a replay that restored
only the global generators would start the next epoch with the generator as the user's code
built it, so with another order than the recorded run's. Its state is captured beside the other
RNG states at every checkpoint and put back once the resumed fit has built its loaders (they do
not exist yet when Lightning hands a callback the checkpoint).
"""

from __future__ import annotations

import warnings

import torch
from lightning.pytorch import Trainer
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader

LOADER_RNG_KEY = "stalwart_loader_rng"


def loader_generators(trainer: Trainer) -> list[torch.Generator]:
    """The generators the training DataLoaders hold (their own, their samplers'), each once, in
    the loaders' order; empty where they draw from the global generator (the default)."""
    loaders: list[DataLoader] = []
    if trainer.train_dataloader is not None:
        apply_to_collection(trainer.train_dataloader, DataLoader, loaders.append)
    found: dict[int, torch.Generator] = {}
    for loader in loaders:
        batch_sampler = getattr(loader, "batch_sampler", None)
        for owner in (loader, loader.sampler, getattr(batch_sampler, "sampler", None)):
            generator = getattr(owner, "generator", None)
            if isinstance(generator, torch.Generator):
                found.setdefault(id(generator), generator)
    return list(found.values())


def capture_loader_rng(trainer: Trainer) -> list[torch.Tensor]:
    """The states of :func:`loader_generators` (tensors: a checkpoint stays weights-only)."""
    return [generator.get_state() for generator in loader_generators(trainer)]


def restore_loader_rng(trainer: Trainer, states: list[torch.Tensor]) -> None:
    """Put the training DataLoaders' generators back where :func:`capture_loader_rng` found them.

    If the loaders now hold other generators than the recorded ones (the data code changed), the
    states cannot be matched: a warning says so and the generators are left as they are.
    """
    generators = loader_generators(trainer)
    if len(generators) != len(states):
        warnings.warn(
            f"the checkpoint holds the state of {len(states)} DataLoader generator(s), and this "
            f"fit's training DataLoaders hold {len(generators)}: their order and worker seeds "
            "are not restored, so the data will differ from the recorded run's. Build the "
            "DataLoaders as the recorded run did (the same generator= arguments).",
            stacklevel=2,
        )
        return
    for generator, state in zip(generators, states, strict=True):
        generator.set_state(state)
