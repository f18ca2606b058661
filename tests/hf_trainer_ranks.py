"""Run by tests/test_hf_trainer.py under ``torchrun --nproc-per-node 2``: the HF Trainer recipe
(examples/hf_trainer.py) and its reference, then Accelerate on its own; rank 0 saves what each gave."""

import sys
from pathlib import Path

import torchvision_compat

torchvision_compat.ensure_torchvision_importable()  # before transformers (see the module)

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.utils.data import DataLoader

import fxzero

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import hf_trainer

STEPS = 3


def accelerate_losses(prepare_model: bool, use_fxzero: bool) -> tuple[list[float], list[torch.Tensor]]:
    """Two steps with Accelerate's own loop; with ``prepare_model`` the model goes through prepare (DDP)."""
    model = hf_trainer.tiny_gpt2()
    if use_fxzero:
        opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, module=model, lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    accelerator = Accelerator(cpu=True)
    loader = DataLoader(hf_trainer.random_tokens(), batch_size=4)
    inner = opt
    if prepare_model:
        model, opt, loader = accelerator.prepare(model, opt, loader)
    else:
        opt, loader = accelerator.prepare(opt, loader)
    losses = []
    for _, batch in zip(range(2), loader):
        loss = model(**batch).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if use_fxzero:
        inner.finish_param_sync()
    return losses, [p.detach().clone() for p in model.parameters()]


def refused_inside_ddp() -> str:
    try:
        accelerate_losses(prepare_model=True, use_fxzero=True)
    except RuntimeError as error:
        return str(error)
    return "ran"


def main() -> None:
    results = {
        "trainer_reference": hf_trainer.train(STEPS, reference=True),
        "trainer_fxzero": hf_trainer.train(STEPS, reference=False),
        "accelerate_reference": accelerate_losses(prepare_model=True, use_fxzero=False),
        "accelerate_fxzero": accelerate_losses(prepare_model=False, use_fxzero=True),
        "accelerate_prepared_model": refused_inside_ddp(),
    }
    if dist.get_rank() == 0:
        torch.save(results, sys.argv[1])


if __name__ == "__main__":
    main()
