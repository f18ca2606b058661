"""Run by tests/test_hf_trainer.py under ``torchrun --nproc-per-node 2``: the HF Trainer recipe
(examples/hf_trainer.py) and its reference, each with gradient accumulation, saving and
resuming; then Accelerate's loop with ``accumulate``, ``save_state`` and ``load_state``; rank 0
saves what each gave."""

import sys
from pathlib import Path
from typing import Any, Optional

import torchvision_compat

torchvision_compat.ensure_torchvision_importable()  # before transformers (see the module)

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import Trainer, TrainingArguments

import fxzero
from fxzero.hugging_face import CheckpointCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import hf_trainer

STEPS = 4


def accelerate_losses(
    use_fxzero: bool, accumulation: int = 1, checkpoint: Optional[Path] = None, steps: int = 2
) -> tuple[list[float], list[torch.Tensor]]:
    """Steps of Accelerate's own loop (``accelerator.accumulate``), under DDP or with fxzero.
    ``checkpoint``: ``save_state`` there after the first step, then resume a fresh model,
    optimizer and accelerator from it with ``load_state``."""
    model, opt, accelerator, loader = _accelerate_setup(use_fxzero, accumulation)
    losses = _accelerate_steps(accelerator, model, opt, loader, range(steps if checkpoint is None else 1))
    if checkpoint is not None:
        accelerator.save_state(str(checkpoint))
        torch.manual_seed(99)  # load_state must restore every generator
        model, opt, accelerator, loader = _accelerate_setup(use_fxzero, accumulation)
        accelerator.load_state(str(checkpoint))
        losses += _accelerate_steps(accelerator, model, opt, loader, range(1, steps))
    if use_fxzero:
        opt.optimizer.finish_param_sync()
    return losses, [p.detach().clone() for p in model.parameters()]


def _accelerate_setup(use_fxzero: bool, accumulation: int, compiled: bool = True) -> tuple[Any, Any, Accelerator, Any]:
    model = hf_trainer.tiny_gpt2()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    loader = DataLoader(hf_trainer.random_tokens(), batch_size=4)
    if use_fxzero:  # the README's recipe: the model is not prepared (DDP would wrap it) but saved with the state
        opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, module=model, lr=1e-2)
        if compiled:
            model.compile(backend="fxzero")
        opt, loader = accelerator.prepare(opt, loader)
        accelerator.register_for_checkpointing(model)
    else:  # compiled with Inductor too: GPT-2's dropout then draws the same masks
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model.compile()
        model, opt, loader = accelerator.prepare(model, opt, loader)
    return model, opt, accelerator, loader


def _accelerate_steps(accelerator: Accelerator, model: Any, opt: Any, loader: Any, steps: range) -> list[float]:
    losses, batches = [], iter(loader)
    for _ in range(steps.start * accelerator.gradient_accumulation_steps):
        next(batches)  # the batches the steps before a resume took
    for _ in steps:
        for _ in range(accelerator.gradient_accumulation_steps):
            with accelerator.accumulate(model):
                loss = model(**next(batches)).loss
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
    return losses


def refused_inside_ddp() -> str:
    try:
        model, opt, accelerator, loader = _accelerate_setup(use_fxzero=True, accumulation=1, compiled=False)  # refused before any compile
        model = accelerator.prepare(model)  # wrapped in DDP
        _accelerate_steps(accelerator, model, opt, loader, range(1))
    except RuntimeError as error:
        return str(error)
    return "ran"


def trainer_runs(root: Path, reference: bool) -> dict[str, Any]:
    """Trainer with 2-step accumulation, saving every 2 steps: 4 steps straight, then 4 steps
    resumed from the checkpoint of step 2 (Trainer's own save and resume)."""
    name = "reference" if reference else "fxzero"
    straight = hf_trainer.train(STEPS, reference, output_dir=str(root / name), save_steps=2, accumulation=2)
    resumed = hf_trainer.train(STEPS, reference, output_dir=str(root / f"{name}-resumed"), resume=str(root / name / "checkpoint-2"),
                               accumulation=2)  # fmt: skip
    return {"straight": straight, "resumed": resumed, "optimizer_file": str(root / name / "checkpoint-2" / "optimizer.pt")}


def trainer_with_an_optimizer_object(output_dir: Path, resume: Optional[Path]) -> tuple[list[float], list[torch.Tensor]]:
    """The other way to hand Trainer an optimizer, ``optimizers=(opt, None)``, built before
    Trainer moves the model (``model.to("cpu:0")`` copies every param) and, on resume, loads the
    checkpoint's weights into those copies: both are taken in (no weight decay: Trainer's
    default of 0, so its groups and this one group train alike)."""
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
        save_strategy="steps", save_steps=2, gradient_accumulation_steps=2, report_to="none", disable_tqdm=True, use_cpu=True,
    )  # fmt: skip
    model = hf_trainer.tiny_gpt2()
    adamw, adamw_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    # Trainer puts weight_decay into its groups, not into these kwargs: AdamW's own default is 0.01
    opt = fxzero.DistributedOptimizer(model.parameters(), adamw, module=model, weight_decay=args.weight_decay, **adamw_kwargs)
    model.compile(backend="fxzero")
    model._is_accelerate_prepared = True
    trainer = Trainer(model=model, args=args, train_dataset=hf_trainer.random_tokens(), optimizers=(opt, None),
                      callbacks=[CheckpointCallback()])  # fmt: skip
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    opt.finish_param_sync()
    return [log["loss"] for log in trainer.state.log_history if "loss" in log], [p.detach().clone() for p in model.parameters()]


def main() -> None:
    root = Path(sys.argv[2])  # shared by the ranks: Trainer writes rank 0's files and each rank's RNG state there
    results = {
        "trainer_reference": trainer_runs(root, reference=True),
        "trainer_fxzero": trainer_runs(root, reference=False),
        "trainer_object": trainer_with_an_optimizer_object(root / "object", None),
        "trainer_object_resumed": trainer_with_an_optimizer_object(root / "object-resumed", root / "object" / "checkpoint-2"),
        "accelerate_reference": accelerate_losses(use_fxzero=False, accumulation=2, checkpoint=root / "acc-ref"),
        "accelerate_fxzero": accelerate_losses(use_fxzero=True, accumulation=2, checkpoint=root / "acc-fxzero"),
        "accelerate_prepared_model": refused_inside_ddp(),
    }
    if dist.get_rank() == 0:
        torch.save(results, sys.argv[1])


if __name__ == "__main__":
    main()
