"""Train a tiny GPT-2 with the Hugging Face Trainer and fxzero: ZeRO-1 AdamW + torch.compile(backend="fxzero").

    torchrun --nproc-per-node 2 examples/hf_trainer.py                # fxzero
    torchrun --nproc-per-node 2 examples/hf_trainer.py --reference    # Trainer's own AdamW, under DDP

Four lines differ from a plain Trainer script, each marked "fxzero" below:

1. Trainer builds a ``fxzero.DistributedOptimizer`` wrapping the optimizer it would build
   itself (``Trainer.get_optimizer_cls_and_kwargs``: fused AdamW with its lr, betas and eps)
   over its own weight-decay groups: ``Trainer(optimizer_cls_and_kwargs=...)``; it builds
   its LR schedule over it;
2. the model is compiled by hand, ``model.compile(backend="fxzero")``:
   ``TrainingArguments(torch_compile_backend="fxzero")`` is refused by Accelerate, whose
   backend names are a fixed list;
3. ``model._is_accelerate_prepared = True``: Accelerate would otherwise wrap the model in
   DDP, which would reduce every gradient again (fxzero refuses to run inside DDP);
4. ``callbacks=[fxzero.hugging_face.CheckpointCallback()]``: Trainer saves the optimizer
   from rank 0 alone, and each rank holds a shard of its state; the callback gathers the
   whole state onto rank 0 right before each save, so ``optimizer.pt`` is complete and
   ``resume_from_checkpoint`` resumes exactly (without it the save fails, naming it).

Trainer builds the optimizer in ``train()``, after it moved the model to ``args.device`` and
loaded a checkpoint's weights. ``gradient_accumulation_steps`` works as under DDP (the
optimizer gives the model the ``no_sync()`` Trainer looks for). Data: random tokens, no downloads.

    torchrun --nproc-per-node 2 examples/hf_trainer.py --steps 4 --save-steps 2 --output-dir out
    torchrun --nproc-per-node 2 examples/hf_trainer.py --steps 4 --output-dir out --resume out/checkpoint-2
"""

import argparse
import contextlib
import tempfile
from typing import Optional

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import fxzero
from fxzero.hugging_face import CheckpointCallback, find_distributed_optimizer


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))


def random_tokens(n: int = 64, length: int = 16) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in ids]


def train(
    steps: int, reference: bool, inner_compiler: str = "inductor", *, output_dir: Optional[str] = None, save_steps: int = 0,
    resume: Optional[str] = None, accumulation: int = 1,
) -> tuple[list[float], list[torch.Tensor]]:
    """Train for ``steps`` steps; the logged losses and the final params. The reference is
    compiled too (``torch_compile=True``: DDP + Inductor) where fxzero's run uses Inductor:
    GPT-2's dropout then draws the same masks in both (Inductor's differ from eager's).
    ``save_steps``: Trainer saves a checkpoint every that many steps into ``output_dir``;
    ``resume``: a checkpoint directory to resume from."""
    with contextlib.ExitStack() as stack:
        out = output_dir or stack.enter_context(tempfile.TemporaryDirectory())
        args = TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
            save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, gradient_accumulation_steps=accumulation,
            report_to="none", disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
            torch_compile=reference and inner_compiler == "inductor",
        )  # fmt: skip
        model = tiny_gpt2().to(args.device)  # creating the arguments set up the process group under torchrun
        optimizer, callbacks = {}, []
        if not reference:
            adamw, adamw_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)  # Trainer's own: fused AdamW, its lr, betas, eps
            optimizer = {"optimizer_cls_and_kwargs": (  # fxzero (1): Trainer builds it over its weight-decay groups
                fxzero.DistributedOptimizer, {"optimizer_class": adamw, "module": model, **adamw_kwargs})}  # fmt: skip
            model.compile(backend="fxzero", options={"inner_compiler": inner_compiler})  # fxzero (2)
            model._is_accelerate_prepared = True  # fxzero (3): Accelerate then neither wraps it in DDP nor moves it
            callbacks = [CheckpointCallback()]  # fxzero (4): Trainer's checkpoints hold the whole optimizer state
        trainer = Trainer(model=model, args=args, train_dataset=random_tokens(), callbacks=callbacks, **optimizer)
        trainer.train(resume_from_checkpoint=resume)
        opt = find_distributed_optimizer(trainer.optimizer)
    if opt is not None:
        opt.finish_param_sync()  # the last step's gathers land in the next forward otherwise
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return losses, [p.detach().clone() for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reference", action="store_true", help="Trainer's own AdamW under DDP (compiled with Inductor unless --inner-compiler eager), no fxzero")
    parser.add_argument("--inner-compiler", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--output-dir", default=None, help="where Trainer writes its checkpoints (a temporary directory by default)")
    parser.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every this many steps (0: none)")
    parser.add_argument("--resume", default=None, help="a checkpoint directory to resume from")
    parser.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps")
    args = parser.parse_args()
    losses, _ = train(args.steps, args.reference, args.inner_compiler, output_dir=args.output_dir, save_steps=args.save_steps,
                      resume=args.resume, accumulation=args.accumulation)  # fmt: skip
    print(" ".join(f"{loss:.4f}" for loss in losses))


if __name__ == "__main__":
    main()
