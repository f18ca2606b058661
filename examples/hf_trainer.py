"""Train a tiny GPT-2 with the Hugging Face Trainer and fxzero: ZeRO-1 AdamW + torch.compile(backend="fxzero").

    torchrun --nproc-per-node 2 examples/hf_trainer.py                # fxzero
    torchrun --nproc-per-node 2 examples/hf_trainer.py --reference    # Trainer's own AdamW, under DDP

Three lines differ from a plain Trainer script, each marked "fxzero" below:

1. the optimizer is a ``fxzero.DistributedOptimizer`` over the model with Trainer's AdamW
   settings (``fused=True``, as ``optim="adamw_torch_fused"``, Trainer's default), handed to
   ``Trainer(optimizers=(opt, None))``; Trainer builds its LR schedule over it;
2. the model is compiled by hand, ``model.compile(backend="fxzero")``:
   ``TrainingArguments(torch_compile_backend="fxzero")`` is refused by Accelerate, whose
   backend names are a fixed list;
3. ``model._is_accelerate_prepared = True``: Accelerate would otherwise wrap the model in
   DDP, which would reduce every gradient again (fxzero refuses to run inside DDP).

Trainer still moves the model to ``args.device``, after the optimizer exists; on the device
the model is already on that is a no-op for fxzero. Data: random tokens, no downloads.
"""

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import fxzero


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))


def random_tokens(n: int = 64, length: int = 16) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in ids]


def train(steps: int, reference: bool, inner_compiler: str = "inductor") -> tuple[list[float], list[torch.Tensor]]:
    """Train for ``steps`` steps; the logged losses and the final params. The reference is
    compiled too (``torch_compile=True``: DDP + Inductor) where fxzero's run uses Inductor:
    GPT-2's dropout then draws the same masks in both (Inductor's differ from eager's)."""
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
            save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
            torch_compile=reference and inner_compiler == "inductor",
        )  # fmt: skip
        model = tiny_gpt2().to(args.device)  # creating the arguments set up the process group under torchrun
        opt = None
        if not reference:
            opt = fxzero.DistributedOptimizer(  # fxzero (1)
                model.parameters(), torch.optim.AdamW, module=model, lr=args.learning_rate, fused=True,
                betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, weight_decay=args.weight_decay,
            )  # fmt: skip
            model.compile(backend="fxzero", options={"inner_compiler": inner_compiler})  # fxzero (2)
            model._is_accelerate_prepared = True  # fxzero (3): Accelerate then neither wraps it in DDP nor moves it
        trainer = Trainer(model=model, args=args, train_dataset=random_tokens(), optimizers=(opt, None))
        trainer.train()
    if opt is not None:
        opt.finish_param_sync()  # the last step's gathers land in the next forward otherwise
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return losses, [p.detach().clone() for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reference", action="store_true", help="Trainer's own AdamW under DDP (compiled with Inductor unless --inner-compiler eager), no fxzero")
    parser.add_argument("--inner-compiler", default="inductor", choices=["inductor", "eager"])
    args = parser.parse_args()
    losses, _ = train(args.steps, args.reference, args.inner_compiler)
    print(" ".join(f"{loss:.4f}" for loss in losses))


if __name__ == "__main__":
    main()
