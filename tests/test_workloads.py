"""The two real workloads that ship offline: a CNN on digits and a char transformer on stdlib text.

Each trains two short epochs with a real ``lightning.Trainer`` and must lower its validation loss;
the datamodules must be deterministic for a seed.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from char_lm import VOCAB_SIZE, CharTransformer, StdlibTextDataModule, decode, encode
from digits_cnn import DigitsCNN, DigitsCNNDataModule

from stalwart.errors import ConfigurationError
from tests.helpers import QUIET


class _ValLosses(L.Callback):
    """Records ``val_loss`` after every real (not sanity-check) validation epoch."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.losses.append(float(trainer.callback_metrics["val_loss"]))


def _fit(model: L.LightningModule, datamodule: L.LightningDataModule, epochs: int):
    record = _ValLosses()
    trainer = L.Trainer(max_epochs=epochs, callbacks=[record], num_sanity_val_steps=0, **QUIET)
    trainer.fit(model, datamodule)
    return trainer, record.losses


def _tensors(loader) -> list[torch.Tensor]:
    return [t for batch in loader for t in batch]


# --- digits CNN -------------------------------------------------------------------------------


def test_digits_cnn_trains_and_val_loss_falls():
    L.seed_everything(0)
    model = DigitsCNN(max_epochs=2)
    assert 100_000 <= sum(p.numel() for p in model.parameters()) <= 300_000
    trainer, losses = _fit(model, DigitsCNNDataModule(), epochs=2)
    assert len(losses) == 2
    assert losses[1] < losses[0]
    # Two epochs already classify most digits (chance is 10%).
    assert float(trainer.callback_metrics["val_acc"]) > 0.85
    assert "train_loss" in trainer.callback_metrics


def test_digits_cnn_datamodule_is_deterministic_for_a_seed():
    a, b, c = DigitsCNNDataModule(seed=0), DigitsCNNDataModule(seed=0), DigitsCNNDataModule(seed=1)
    for dm in (a, b, c):
        dm.setup()
    for split in ("train", "val", "test"):
        for x, y in zip(getattr(a, split).tensors, getattr(b, split).tensors, strict=True):
            assert torch.equal(x, y)
    assert not torch.equal(a.val.tensors[1], c.val.tensors[1])
    n_train, n_val, n_test = len(a.train), len(a.val), len(a.test)
    assert n_train + n_val + n_test == 1797
    assert n_val == round(1797 * 0.2)
    x, _ = a.train.tensors
    assert x.shape[1:] == (1, 8, 8)
    # Standardised with training statistics.
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1) < 1e-4


def test_digits_cnn_rejects_impossible_split():
    with pytest.raises(ConfigurationError, match="val_fraction"):
        DigitsCNNDataModule(val_fraction=0.7, test_fraction=0.3)


# --- char transformer on stdlib text ------------------------------------------------------------


def test_char_transformer_trains_and_val_loss_falls():
    L.seed_everything(0)
    dm = StdlibTextDataModule(num_chars=100_000, batches_per_epoch=20)
    model = CharTransformer(dm.vocab_size, block_size=dm.block_size, warmup_steps=10)
    trainer, losses = _fit(model, dm, epochs=2)
    assert len(losses) == 2
    assert losses[1] < losses[0]
    # Better than a uniform guess over the vocabulary (log(98) = 4.58 nats per character).
    assert losses[1] < 0.9 * torch.log(torch.tensor(float(VOCAB_SIZE)))
    metrics = trainer.callback_metrics
    assert float(metrics["val_bpc"]) == pytest.approx(float(metrics["val_loss"]) / 0.693147, 1e-4)
    assert "train_loss" in metrics
    # Lightning called set_epoch on the window sampler, so the two epochs drew different windows.
    assert trainer.train_dataloader.sampler.epoch == 1


def test_stdlib_text_datamodule_is_deterministic_for_a_seed():
    def batches(seed: int, epoch: int = 0) -> list[torch.Tensor]:
        dm = StdlibTextDataModule(num_chars=50_000, seed=seed, batches_per_epoch=3)
        dm.setup()
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(epoch)
        return _tensors(loader) + _tensors(dm.val_dataloader())

    first, again = batches(0), batches(0)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], batches(1)[0])
    assert not torch.equal(first[0], batches(0, epoch=1)[0])
    x, y = first[0], first[1]
    assert x.shape == y.shape == (32, 64)
    # Targets are the inputs shifted by one character.
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.min()) >= 0 and int(x.max()) < VOCAB_SIZE


def test_stdlib_corpus_is_real_python_source():
    dm = StdlibTextDataModule(num_chars=20_000)
    dm.setup()
    ids = torch.cat([dm.train_ids, dm.val_ids])
    assert len(ids) == 20_000
    text = decode(ids)
    assert "def " in text and "import " in text
    assert torch.equal(encode(text.replace("\ufffd", "\x00")), ids)
    # Almost every character of Python source is inside the fixed vocabulary.
    assert float((ids == 0).float().mean()) < 0.01


def test_char_lm_rejects_bad_configuration():
    with pytest.raises(ConfigurationError, match="num_chars"):
        StdlibTextDataModule(num_chars=100, block_size=64)
    with pytest.raises(ConfigurationError, match="n_heads"):
        CharTransformer(VOCAB_SIZE, d_model=130, n_heads=4)
    with pytest.raises(ConfigurationError, match="min_lr_ratio"):
        CharTransformer(VOCAB_SIZE, decay_steps=100, min_lr_ratio=1.5)


def test_char_transformer_learning_rate_warms_up_then_stays_or_decays_by_a_cosine():
    def rates(**hparams) -> list[float]:
        model = CharTransformer(VOCAB_SIZE, lr=1.0, warmup_steps=10, **hparams)
        optimizer, scheduler = (x[0] for x in model.configure_optimizers())
        seen = []
        for _ in range(40):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler["scheduler"].step()
        return seen

    constant, cosine = rates(), rates(decay_steps=20, min_lr_ratio=0.1)
    assert constant[:10] == pytest.approx([(step + 1) / 10 for step in range(10)])
    assert constant[10:] == [1.0] * 30
    assert cosine[:10] == constant[:10]
    # Half-way through the decay the cosine is at the middle of [0.1, 1]; then it stays at 0.1.
    assert cosine[19] == pytest.approx(0.55)
    assert all(a > b for a, b in zip(cosine[9:29], cosine[10:30], strict=True))
    assert cosine[29:] == pytest.approx([0.1] * 11)
