"""A small character-level transformer on the Python standard library's own source code.

The corpus is built from the ``.py`` files of the running interpreter's standard library (found via
``sysconfig``), so it ships offline on every machine with Python and nothing is downloaded. The
corpus is deterministic for one Python installation; a different Python version gives different
(but equally deterministic) text.

Run it directly for a quick check::

    python examples/char_lm.py --epochs 10
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from stalwart.errors import ConfigurationError

#: Id 0 stands for every character outside the vocabulary.
UNKNOWN_ID = 0
#: Tab, newline and printable ASCII; everything else maps to ``UNKNOWN_ID``.
VOCAB: str = "\t\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = len(VOCAB) + 1

# Code point -> id for ASCII; anything >= 128 is unknown.
_ASCII_TO_ID = np.full(128, UNKNOWN_ID, dtype=np.int64)
_ASCII_TO_ID[[ord(c) for c in VOCAB]] = np.arange(1, VOCAB_SIZE)

# Directories that are not part of the library proper, or that vary between installations.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"}


def encode(text: str) -> torch.Tensor:
    """Map ``text`` to a 1-D tensor of ids (vectorised through UTF-32 code points)."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ids = np.full(codes.shape, UNKNOWN_ID, dtype=np.int64)
    ascii_mask = codes < 128
    ids[ascii_mask] = _ASCII_TO_ID[codes[ascii_mask]]
    return torch.from_numpy(ids)


def decode(ids: torch.Tensor) -> str:
    """Map ids back to text; unknown ids become U+FFFD."""
    table = "\ufffd" + VOCAB
    return "".join(table[i] for i in ids.tolist())


def stdlib_source_files(stdlib: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files in a fixed (sorted by relative path) order."""
    return [Path(p) for p in _source_files(str(stdlib or sysconfig.get_paths()["stdlib"]))]


@functools.lru_cache(maxsize=4)
def _source_files(root: str) -> tuple[str, ...]:
    found: list[tuple[str, str]] = []
    for directory, subdirs, names in os.walk(root):
        # Prune in place so the walk never descends into skipped trees (the test suite is big).
        subdirs[:] = [d for d in subdirs if d not in _SKIP_DIRS]
        relative = os.path.relpath(directory, root)
        for name in names:
            if name.endswith(".py"):
                key = Path(relative, name).as_posix()
                found.append((key, os.path.join(directory, name)))
    return tuple(path for _, path in sorted(found))


def stdlib_corpus(num_chars: int, stdlib: Path | None = None) -> str:
    """The first ``num_chars`` characters of the concatenated standard-library sources."""
    pieces: list[str] = []
    total = 0
    for path in stdlib_source_files(stdlib):
        text = path.read_text(encoding="utf-8", errors="replace") + "\n"
        pieces.append(text)
        total += len(text)
        if total >= num_chars:
            return "".join(pieces)[:num_chars]
    raise ConfigurationError(
        f"the standard library at {stdlib or sysconfig.get_paths()['stdlib']} has only {total} "
        f"characters of source, fewer than num_chars={num_chars}; pass a smaller num_chars"
    )


class _Windows(Dataset):
    """Indexed by a 1-D tensor of window starts; returns a whole batch of (input, target)."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data = data
        self.offsets = torch.arange(block_size + 1)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[starts[:, None] + self.offsets]
        return chunk[:, :-1], chunk[:, 1:]


class RandomWindowBatches(Sampler[torch.Tensor]):
    """Yields ``num_batches`` tensors of random window starts, drawn from ``(seed, epoch)``.

    Like ``DistributedSampler``, the draw depends on ``set_epoch`` (Lightning calls it at the
    start of every epoch), so each epoch sees new windows and a resumed run sees the same ones.
    """

    def __init__(self, num_starts: int, batch_size: int, num_batches: int, seed: int) -> None:
        self.num_starts = num_starts
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        starts = torch.randint(
            self.num_starts, (self.num_batches, self.batch_size), generator=generator
        )
        yield from starts


class StdlibTextDataModule(L.LightningDataModule):
    """Characters of the Python standard library's source, as next-character prediction windows.

    The first ``1 - val_fraction`` of the corpus trains, the rest validates. Training draws
    ``batches_per_epoch`` batches of random windows per epoch (so an epoch is short and its length
    does not depend on the corpus size); validation uses every non-overlapping window of the
    validation text, the same every epoch.

    Args:
        block_size: characters of context per window.
        batch_size: windows per training batch.
        num_chars: size of the corpus in characters.
        val_fraction: fraction of the corpus held out for validation.
        seed: seed of the random training windows.
        batches_per_epoch: training batches per epoch.
        val_batch_size: windows per validation batch.

    Example::

        dm = StdlibTextDataModule(block_size=64, batch_size=32, num_chars=400_000)
        dm.setup()
        x, y = next(iter(dm.train_dataloader()))  # both (32, 64); y is x shifted by one
    """

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 32,
        num_chars: int = 400_000,
        val_fraction: float = 0.1,
        seed: int = 0,
        batches_per_epoch: int = 100,
        val_batch_size: int = 128,
    ) -> None:
        super().__init__()
        if not 0 < val_fraction < 1:
            raise ConfigurationError(f"val_fraction={val_fraction} must be in (0, 1), e.g. 0.1")
        if min(block_size, batch_size, batches_per_epoch, val_batch_size) < 1:
            raise ConfigurationError(
                "block_size, batch_size, batches_per_epoch and val_batch_size must be >= 1"
            )
        if num_chars * min(val_fraction, 1 - val_fraction) < 2 * (block_size + 1):
            raise ConfigurationError(
                f"num_chars={num_chars} is too small for block_size={block_size} and "
                f"val_fraction={val_fraction}: each split needs at least two windows"
            )
        self.block_size = block_size
        self.batch_size = batch_size
        self.num_chars = num_chars
        self.val_fraction = val_fraction
        self.seed = seed
        self.batches_per_epoch = batches_per_epoch
        self.val_batch_size = val_batch_size
        self.vocab_size = VOCAB_SIZE

    def setup(self, stage: str | None = None) -> None:
        if hasattr(self, "train_ids"):
            return
        ids = encode(stdlib_corpus(self.num_chars))
        n_train = int(len(ids) * (1 - self.val_fraction))
        self.train_ids, self.val_ids = ids[:n_train], ids[n_train:]

    def train_dataloader(self) -> DataLoader:
        sampler = RandomWindowBatches(
            num_starts=len(self.train_ids) - self.block_size,
            batch_size=self.batch_size,
            num_batches=self.batches_per_epoch,
            seed=self.seed,
        )
        # batch_size=None: the sampler already yields whole batches of starts.
        windows = _Windows(self.train_ids, self.block_size)
        return DataLoader(windows, sampler=sampler, batch_size=None)

    def val_dataloader(self) -> DataLoader:
        num_windows = (len(self.val_ids) - 1) // self.block_size
        starts = torch.arange(num_windows) * self.block_size
        batches = list(starts.split(self.val_batch_size))
        return DataLoader(_Windows(self.val_ids, self.block_size), sampler=batches, batch_size=None)


class CharTransformer(L.LightningModule):
    """A small causal (GPT-style, pre-norm) transformer over characters.

    Token and learned position embeddings, ``n_layers`` ``nn.TransformerEncoderLayer`` blocks with
    a causal mask, a final LayerNorm and a linear head. AdamW with a short linear warm-up, then a
    constant learning rate or, with ``decay_steps``, a cosine decay. Logs
    ``train_loss``, ``val_loss`` (nats per character) and ``val_bpc`` (bits per character).

    Args:
        vocab_size: number of token ids (``StdlibTextDataModule.vocab_size``).
        d_model: embedding width.
        n_layers: transformer blocks.
        n_heads: attention heads per block.
        block_size: longest context (size of the position embedding).
        lr: AdamW learning rate.
        dropout: dropout inside the blocks and after the embeddings (0 by default: on CPU,
            drawing the dropout masks cost about a third of a training step).
        weight_decay: AdamW weight decay.
        warmup_steps: optimizer steps of linear learning-rate warm-up.
        ff_mult: width of each block's feed-forward layer, in multiples of ``d_model``
            (2 instead of 4 makes a step ~1/3 cheaper).
        decay_steps: 0 keeps the learning rate constant after the warm-up; otherwise it follows
            a cosine from ``lr`` down to ``min_lr_ratio * lr`` over this many optimizer steps
            after the warm-up, and stays there.
        min_lr_ratio: where the cosine ends, as a fraction of ``lr``.

    Example::

        dm = StdlibTextDataModule()
        model = CharTransformer(dm.vocab_size, block_size=dm.block_size)
        L.Trainer(max_epochs=10).fit(model, dm)
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 128,
        n_layers: int = 2,
        n_heads: int = 4,
        block_size: int = 64,
        lr: float = 3e-3,
        dropout: float = 0.0,
        weight_decay: float = 0.01,
        warmup_steps: int = 50,
        ff_mult: int = 4,
        decay_steps: int = 0,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ConfigurationError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        if decay_steps < 0 or not 0.0 <= min_lr_ratio <= 1.0:
            raise ConfigurationError(
                f"decay_steps must be >= 0 and min_lr_ratio in [0, 1], got {decay_steps} and "
                f"{min_lr_ratio}"
            )
        self.save_hyperparameters()
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(block_size, d_model)
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(
            d_model,
            n_heads,
            dim_feedforward=ff_mult * d_model,
            dropout=dropout,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, time, vocab_size)`` for ids of shape ``(batch, time)``."""
        length = ids.shape[1]
        if length > self.hparams.block_size:
            raise ConfigurationError(
                f"sequence length {length} exceeds block_size={self.hparams.block_size}"
            )
        positions = torch.arange(length, device=ids.device)
        x = self.dropout(self.token_embedding(ids) + self.position_embedding(positions))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=ids.device)
        x = self.blocks(x, mask=mask, is_causal=True)
        return self.head(self.norm(x))

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        loss = self._loss(batch)
        # Every validation batch but the last is full, so the mean of batch means is ~exact.
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_bpc", loss / math.log(2), prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )
        # A plain function, not the bound method: LambdaLR's state_dict stores only callables that
        # are objects, so the checkpoint's scheduler state stays as it was before decay_steps.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: self._lr_factor(s))
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]

    def _lr_factor(self, step: int) -> float:
        warmup = max(1, self.hparams.warmup_steps)
        if step + 1 < warmup or not self.hparams.decay_steps:
            return min(1.0, (step + 1) / warmup)
        done = min(1.0, (step + 1 - warmup) / self.hparams.decay_steps)
        floor = self.hparams.min_lr_ratio
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * done))

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, num_chars: int) -> torch.Tensor:
        """Sample ``num_chars`` characters after ``prompt`` (a 1-D tensor of ids)."""
        ids = prompt[None]
        for _ in range(num_chars):
            logits = self(ids[:, -self.hparams.block_size :])[:, -1]
            next_id = torch.multinomial(logits.softmax(-1), 1)
            ids = torch.cat([ids, next_id], dim=1)
        return ids[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batches-per-epoch", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    L.seed_everything(args.seed)
    datamodule = StdlibTextDataModule(seed=args.seed, batches_per_epoch=args.batches_per_epoch)
    model = CharTransformer(datamodule.vocab_size, block_size=datamodule.block_size)

    class _Report(L.Callback):
        def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if not trainer.sanity_checking:
                m = trainer.callback_metrics
                print(
                    f"epoch {trainer.current_epoch}: val_loss={float(m['val_loss']):.3f} "
                    f"val_bpc={float(m['val_bpc']):.3f} t={time.perf_counter() - start:.1f}s"
                )

    trainer = L.Trainer(
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        callbacks=[_Report()],
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule)
    elapsed = time.perf_counter() - start
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params={n_params} fit_seconds={elapsed:.1f}")
    prompt = datamodule.val_ids[:32]
    print(repr(decode(prompt)), "->", repr(decode(model.eval().generate(prompt, 120)[32:])))


if __name__ == "__main__":
    main()
