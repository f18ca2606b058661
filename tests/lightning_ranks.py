"""Run by tests/test_lightning.py under ``torchrun --nproc-per-node 2``: Lightning's ``strategy="ddp"``
with torch.optim.AdamW (the reference) and ``fxzero.lightning.FxzeroStrategy`` with a
fxzero.DistributedOptimizer, the model compiled with Inductor (its dropout on, as nn.Dropout ships);
each rank saves what each run gave to ``<out>.<rank>.pt``.

Dropout masks are drawn per micro-batch from a seed made of the epoch, the batch and the rank, so a
run resumed from a checkpoint draws the masks the uninterrupted run drew; the ``*_unseeded`` runs seed
each rank once, before the fit, so a resume draws the uninterrupted run's masks only if the checkpoint
brought back each rank's generators (FxzeroStrategy carries them)."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torchvision_compat

torchvision_compat.ensure_torchvision_importable()  # before lightning: torchmetrics imports torchvision (see the module)

import lightning.pytorch as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fxzero
from fxzero.lightning import FxzeroStrategy

LR, EPOCHS, BATCH = 1e-2, 2, 4
warnings.filterwarnings("ignore", ".*does not have many workers.*")


class Classifier(L.LightningModule):
    """An MLP with nn.Dropout() (p=0.5); ``fxzero`` picks the optimizer and the compile backend."""

    def __init__(self, use_fxzero: bool, extra: bool = False, reseed: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(), nn.Linear(32, 4))
        self.net.compile(backend="fxzero" if use_fxzero else "inductor")
        self.left_out = nn.Linear(2, 2) if extra else None  # a param no optimizer manages
        self.use_fxzero, self.reseed, self.losses = use_fxzero, reseed, []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.reseed:
            torch.manual_seed(1000 * self.current_epoch + 10 * batch_idx + self.global_rank)  # the dropout masks
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.use_fxzero:
            params = self.net.parameters()
            return fxzero.DistributedOptimizer(params, torch.optim.AdamW, module=self, lr=LR)
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader:
        data = torch.Generator().manual_seed(1)
        x, y = torch.randn(64, 16, generator=data), torch.randint(0, 4, (64,), generator=data)
        return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def _trainer(strategy: Any, epochs: int, accumulate: int = 1, callbacks: Any = ()) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, accumulate_grad_batches=accumulate,
        logger=False, enable_checkpointing=bool(callbacks), callbacks=list(callbacks), enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip


def fit(
    use_fxzero: bool, epochs: int = EPOCHS, accumulate: int = 1, ckpt_dir: str = "", resume: str = "", reseed: bool = True
) -> dict[str, Any]:
    """Losses of every micro-batch this rank ran, and the params after the fit. ``reseed=False``:
    each rank's generator is seeded once, here (a resume must restore it from the checkpoint)."""
    model = Classifier(use_fxzero, reseed=reseed)
    if not reseed:
        torch.manual_seed(100 + int(os.environ["RANK"]) + (7 if resume else 0))  # a resume starts from other states
    callbacks = [L.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)] if ckpt_dir else []
    trainer = _trainer(FxzeroStrategy() if use_fxzero else "ddp", epochs, accumulate, callbacks)
    trainer.fit(model, ckpt_path=resume or None)
    return dict(losses=[float(x) for x in model.losses], params={n: p.detach().clone() for n, p in model.named_parameters()})


def refused(strategy: str, extra: bool) -> str:
    """A fxzero model under ``strategy="ddp"``, or a param left out of the optimizer under FxzeroStrategy."""
    try:
        _trainer(FxzeroStrategy() if strategy == "fxzero" else strategy, 1).fit(Classifier(True, extra=extra))
    except (RuntimeError, ValueError) as error:
        return str(error)
    return "ran"


def main() -> None:
    out, ckpt_dir = sys.argv[1], sys.argv[2]
    results: dict[str, Any] = {
        "reference": fit(False),
        "fxzero": fit(True, ckpt_dir=ckpt_dir),
    }
    first = sorted(Path(ckpt_dir).glob("epoch=0-*.ckpt"))
    results["checkpoints"] = [p.name for p in sorted(Path(ckpt_dir).glob("*.ckpt"))]
    results["saved"] = torch.load(first[0], weights_only=False) if first and dist.get_rank() == 0 else None
    results["resumed"] = fit(True, resume=str(first[0])) if first else None
    unseeded = Path(ckpt_dir) / "unseeded"
    results["fxzero_unseeded"] = fit(True, ckpt_dir=str(unseeded), reseed=False)
    results["resumed_unseeded"] = fit(True, resume=str(next(unseeded.glob("epoch=0-*.ckpt"))), reseed=False)
    results["reference_accumulate"] = fit(False, epochs=1, accumulate=2)
    results["fxzero_accumulate"] = fit(True, epochs=1, accumulate=2)
    results["ddp_strategy"] = refused("ddp", extra=False)
    results["left_out"] = refused("fxzero", extra=True)
    torch.save(results, f"{out}.{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
