"""A model zoo nobody here wrote: tiny timm and Hugging Face models built from config
objects (no downloads), with their data and losses, for ``test_zoo.py``.

Each family brings something the hand-written test models lack: convs whose weights
Inductor converts to channels-last (ResNet, ConvNeXt, MobileNet with depthwise convs and
squeeze-excite, a ViT's patch embedding), BatchNorm, an encoder-decoder with tied
embeddings (T5), mixture-of-experts routing with experts left without tokens (Mixtral:
its expert loop graph-breaks on ``nonzero``), a conv front-end on audio features
(Whisper), and Hugging Face's own losses.

Each is shrunk in depth and width only: regularisation stays as the library ships it (T5's
dropout 0.1; timm's drop rates, Mixtral's and Whisper's dropouts default to 0).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchvision_compat

torchvision_compat.ensure_torchvision_importable()

import timm  # noqa: E402  (after the torchvision shim)
from transformers import (  # noqa: E402
    MixtralConfig,
    MixtralForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
    WhisperConfig,
    WhisperForConditionalGeneration,
)

__all__ = ["ZOO", "Case"]

Batch = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    data: Callable[[int, int], Batch]
    """``(step, global batch size) -> batch``, every tensor batch-first. The zoo's models see
    one fixed batch every step (the loss falls within a few steps; the step is ignored)."""
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    inner: str = "inductor"
    """The inner compiler its test runs under: Inductor where Inductor's generated code is
    the subject (ResNet: convs, whose weights it copies to channels-last, with BatchNorm and
    strided shortcuts; the adapters picked in Python); the eager one where the subject is
    fxzero's graphs of that family and its Inductor case is elsewhere: the transformer families
    (tied weights, an encoder-decoder, experts behind a graph break; ``test_hf_models.py`` and
    ``test_param_read_order.py``), the ViT (its patch-embedding conv), ConvNeXt and EfficientNet
    (depthwise convs, squeeze-excite), whose layers ``test_conv_read_order.py`` checks in
    Inductor's code. A cold Inductor compile of each of these cost the suite 10-35 s."""


def _images(step: int, size: int) -> Batch:
    g = torch.Generator().manual_seed(100)
    return {"x": torch.randn(size, 3, 64, 64, generator=g), "y": torch.randint(0, 10, (size,), generator=g)}


def _classify(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def _tokens(step: int, size: int, length: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(200)
    start, stride = torch.randint(1, 64, (size, 1), generator=g), torch.randint(1, 4, (size, 1), generator=g)
    return (start + stride * torch.arange(length)) % 63 + 1


def _text(step: int, size: int) -> Batch:
    tokens = _tokens(step, size)
    return {"input_ids": tokens, "labels": tokens}


def _audio(step: int, size: int) -> Batch:
    g = torch.Generator().manual_seed(300)
    return {"input_features": torch.randn(size, 8, 32, generator=g), "labels": _tokens(step, size)}


def _hf_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(**batch).loss


def _timm(name: str, **kwargs: object) -> Callable[[], nn.Module]:
    return lambda: timm.create_model(name, pretrained=False, num_classes=10, **kwargs)


def _t5() -> nn.Module:
    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
                      decoder_start_token_id=0, pad_token_id=0, tie_word_embeddings=True)  # fmt: skip
    return T5ForConditionalGeneration(config)


def _mixtral() -> nn.Module:
    # 8 experts, 2 per token, 8 tokens per rank: most steps leave some expert without tokens on a rank.
    # experts_implementation="eager": the loop over the experts some token picked (its graph breaks on
    # ``nonzero``); transformers 5 defaults to a grouped-matmul fallback without that loop
    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=16,
                           tie_word_embeddings=False, experts_implementation="eager")  # fmt: skip
    return MixtralForCausalLM(config)


def _whisper() -> nn.Module:
    config = WhisperConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                           max_source_positions=16, max_target_positions=16, pad_token_id=0,
                           bos_token_id=0, eos_token_id=0, decoder_start_token_id=0)  # fmt: skip
    return WhisperForConditionalGeneration(config)


ZOO: dict[str, Case] = {
    "resnet": Case(_timm("resnet10t", channels=(8, 16, 32, 64), stem_width=8), _images, _classify),
    "vit": Case(_timm("vit_tiny_patch16_224", img_size=64, patch_size=16, embed_dim=64, depth=2, num_heads=2), _images, _classify,
                inner="eager"),
    "convnext": Case(_timm("convnext_atto", depths=(1, 1, 1, 1), dims=(8, 16, 32, 64)), _images, _classify, inner="eager"),
    "efficientnet": Case(_timm("test_efficientnet"), _images, _classify, inner="eager"),  # depthwise convs, squeeze-excite
    "t5": Case(_t5, _text, _hf_loss, inner="eager"),
    "mixtral": Case(_mixtral, _text, _hf_loss, inner="eager"),
    "whisper": Case(_whisper, _audio, _hf_loss, inner="eager"),
}
