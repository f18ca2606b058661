"""TARGETs for ``fxzero explain`` / ``fxzero parity`` on stock Hugging Face models built from
their default configs, dropout on, shrunk in depth and width only (2 layers, hidden 32, vocab
64): what a new user points the tools at. No wrapper: the tools read the ``ModelOutput``.
``broken_gpt2`` adds a rank-dependent term on one param (``transformer.ln_f.bias``), a bug
the parity check must name."""

from __future__ import annotations

import torchvision_compat

torchvision_compat.ensure_torchvision_importable()  # rank processes load this file without conftest

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    T5Config,
    T5ForConditionalGeneration,
)

VOCAB, GLOBAL, LENGTH = 64, 4, 8


def _gpt2() -> torch.nn.Module:
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=16, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0))


def _bert() -> torch.nn.Module:
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=16)
    return BertForMaskedLM(config)


def _t5() -> torch.nn.Module:
    config = T5Config(d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, vocab_size=VOCAB, decoder_start_token_id=0)
    return T5ForConditionalGeneration(config)


class BrokenGPT2(GPT2LMHeadModel):
    """GPT-2 whose loss on rank 1 carries an extra term on one param: the bug parity must name."""

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        output = super().forward(*args, **kwargs)
        rank = dist.get_rank() if dist.is_initialized() else 0
        output.loss = output.loss + 0.1 * rank * self.transformer.ln_f.bias.square().sum()
        return output


BUILDERS = {"gpt2": _gpt2, "bert": _bert, "t5": _t5}


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL, LENGTH), generator=torch.Generator().manual_seed(step))


def batch(step: int) -> dict[str, torch.Tensor]:
    """The forward's keyword arguments: the labels are the inputs (the models shift them themselves)."""
    ids = _ids(step)
    return {"input_ids": ids, "labels": ids}


def _parity(name: str):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return BUILDERS[name](), batch


def gpt2():  # type: ignore[no-untyped-def]
    return _parity("gpt2")


def bert():  # type: ignore[no-untyped-def]
    return _parity("bert")


def t5():  # type: ignore[no-untyped-def]
    return _parity("t5")


def broken_gpt2():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return BrokenGPT2(_gpt2().config), batch


def explain_gpt2():  # type: ignore[no-untyped-def]
    """Inputs only: the backward starts from the logits."""
    torch.manual_seed(0)
    return _gpt2(), {"input_ids": _ids(0)}


def explain_bert():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return _bert(), {"input_ids": _ids(0)}


def explain_t5():  # type: ignore[no-untyped-def]
    """Labels too: T5 needs them (or decoder inputs); the backward starts from its loss."""
    return t5()[0], batch(0)
