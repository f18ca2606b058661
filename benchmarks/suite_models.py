"""The models of ``model_suite.py``: every model of PyTorch's own torch.compile benchmark lists
(``benchmarks/dynamo/huggingface_models_list_cpu.txt`` and ``timm_models_list.txt`` in
pytorch/pytorch), plus timm's ``mixer_b16_224`` from its older list, each built from its
config object (no downloads) and shrunk to train on a 2-core CPU.

Shrinking keeps the architecture and every regularisation default: dropout, attention
dropout, drop-path and LayerDrop stay as the config or model class ships them (the Hugging
Face models their 0.1 dropouts, M2M100 its 0.05 LayerDrop, Swin its drop-path rising to 0.1,
GhostNet its 0.2 head dropout; timm's other defaults are 0);
only depth, width, vocabulary, positions and the input size shrink. Hugging Face models get
2 layers, hidden 64, 2-4 heads, intermediate 128, vocab 256 and 32 tokens (BigBird 64: its
block-sparse attention needs more than (5 + 2 x random blocks) x block size tokens, below
which it falls back to full attention). timm models get the kwargs their constructors take
(depth(s), dims, widths, ``img_size``); those with a fixed layout (Inception v3) get only a
smaller image. :attr:`Entry.shrink` records each model's shrink; the table prints it.

How PyTorch names map to classes: ``huggingface.py`` builds a listed name as the
``transformers`` class of that name from ``config_class()``; its extra models are
AllenaiLongformerBase (``LongformerConfig``, masked LM), BigBird (``BigBirdConfig(
attention_type="block_sparse")``, masked LM), DistillGPT2 (``GPT2Config``, causal LM),
GoogleFnet (``FNetConfig``, masked LM), T5Small (``T5Config``: t5-small is its default,
seq2seq LM) and YituTechConvBert (``ConvBertConfig``, masked LM). Pretrained tags in the timm
list (``.fb_in1k``, ``.lvd142m``) name weights, not architectures: the architecture is built.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchvision_compat

torchvision_compat.ensure_torchvision_importable()  # before timm and transformers import torchvision

import timm  # noqa: E402
import transformers  # noqa: E402
from timm.layers import get_act_layer  # noqa: E402
from timm.models import byobnet, efficientnet, ghostnet, mlp_mixer, mobilevit, nfnet  # noqa: E402
from timm.models._efficientnet_builder import decode_arch_def  # noqa: E402

__all__ = ["HF_LIST", "MODELS", "SKIPS", "TIMM_LIST", "TINY", "Entry", "batch", "entry", "loss"]

Batch = dict[str, torch.Tensor]

HF_LIST = (
    "AlbertForMaskedLM", "AllenaiLongformerBase", "BartForCausalLM", "BertForMaskedLM", "BigBird",
    "BlenderbotForCausalLM", "DebertaV2ForMaskedLM", "DistilBertForMaskedLM", "DistillGPT2", "ElectraForCausalLM",
    "GoogleFnet", "GPT2ForSequenceClassification", "LayoutLMForMaskedLM", "M2M100ForConditionalGeneration",
    "MBartForCausalLM", "MegatronBertForCausalLM", "MobileBertForMaskedLM", "MT5ForConditionalGeneration",
    "OPTForCausalLM", "PegasusForCausalLM", "PLBartForCausalLM", "RobertaForCausalLM", "T5ForConditionalGeneration",
    "T5Small", "TrOCRForCausalLM", "XGLMForCausalLM", "XLNetLMHeadModel", "YituTechConvBert",
)  # fmt: skip
"""PyTorch's ``benchmarks/dynamo/huggingface_models_list_cpu.txt``, in its order."""

TIMM_LIST = (
    "adv_inception_v3", "beit_base_patch16_224", "convnextv2_nano.fcmae_ft_in22k_in1k",
    "deit_base_distilled_patch16_224", "deit_tiny_patch16_224.fb_in1k", "dm_nfnet_f0", "ghostnet_100", "inception_v3",
    "mobilenetv2_100", "mobilenetv3_large_100", "mobilevit_s", "nfnet_l0", "repvgg_a2", "swin_base_patch4_window7_224",
    "tf_efficientnet_b0", "visformer_small", "vit_base_patch14_dinov2.lvd142m", "vit_base_patch16_siglip_256",
)  # fmt: skip
"""PyTorch's ``benchmarks/dynamo/timm_models_list.txt``, in its order (``mixer_b16_224``,
from its older list, is added below for the MLP-mixer family)."""

VOCAB, SEQ, CLASSES = 256, 32, 10


@dataclasses.dataclass(frozen=True)
class Entry:
    """One model of the suite: how to build it and what it eats."""

    family: str
    build: Callable[[], nn.Module]
    """Builds the shrunk model (seeded by the caller)."""
    inputs: str
    """``"tokens"``, ``"seq2seq"``, ``"classify-tokens"`` or ``"images"``."""
    size: int = SEQ
    """Tokens per sequence, or the image's side in pixels."""
    shrink: str = ""
    """What was shrunk, for the table."""
    known: str = ""
    """A failure known to be outside fxzero, put in the note of a row that does not pass."""


# ---------------------------------------------------------------------------------------------
# Hugging Face
# ---------------------------------------------------------------------------------------------

_BERT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
             max_position_embeddings=64)  # fmt: skip
_BART = dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
             decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64)  # fmt: skip
_T5 = dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4)


def _hf_build(model_cls: str, config_cls: str, config: dict) -> nn.Module:
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))


def _hf(family: str, model_cls: str, config_cls: str, inputs: str = "tokens", size: int = SEQ, **config: object) -> Entry:
    shrink = ", ".join(f"{k}={v}" for k, v in config.items() if k not in ("vocab_size",))
    build = functools.partial(_hf_build, model_cls, config_cls, config)
    return Entry(family, build, inputs, size, f"vocab {VOCAB}, seq {size}, {shrink}")


_HF: dict[str, Entry] = {
    "AlbertForMaskedLM": _hf("encoder", "AlbertForMaskedLM", "AlbertConfig", **_BERT, embedding_size=32),
    "AllenaiLongformerBase": _hf("long-context", "LongformerForMaskedLM", "LongformerConfig", **_BERT,
                                 attention_window=8),  # sliding windows of 8 over 32 tokens
    "BartForCausalLM": _hf("decoder", "BartForCausalLM", "BartConfig", **_BART),
    "BertForMaskedLM": _hf("encoder", "BertForMaskedLM", "BertConfig", **_BERT),
    "BigBird": _hf("long-context", "BigBirdForMaskedLM", "BigBirdConfig", size=64, **_BERT, attention_type="block_sparse",
                   block_size=4, num_random_blocks=2),
    "BlenderbotForCausalLM": _hf("decoder", "BlenderbotForCausalLM", "BlenderbotConfig", **_BART),
    "DebertaV2ForMaskedLM": _hf("encoder", "DebertaV2ForMaskedLM", "DebertaV2Config", **_BERT),
    "DistilBertForMaskedLM": _hf("encoder", "DistilBertForMaskedLM", "DistilBertConfig", vocab_size=VOCAB, dim=64, n_layers=2,
                                 n_heads=2, hidden_dim=128, max_position_embeddings=64),
    "DistillGPT2": _hf("decoder", "GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2,
                       n_inner=128, n_positions=64),
    "ElectraForCausalLM": _hf("encoder", "ElectraForCausalLM", "ElectraConfig", **_BERT, embedding_size=32),
    "GoogleFnet": _hf("encoder", "FNetForMaskedLM", "FNetConfig", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                      intermediate_size=128, max_position_embeddings=64),
    "GPT2ForSequenceClassification": _hf("decoder", "GPT2ForSequenceClassification", "GPT2Config", "classify-tokens",
                                         vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, n_inner=128, n_positions=64,
                                         pad_token_id=0),  # as PyTorch sets: batches > 1 need a pad token
    "LayoutLMForMaskedLM": _hf("encoder", "LayoutLMForMaskedLM", "LayoutLMConfig", **_BERT),
    "M2M100ForConditionalGeneration": _hf("encoder-decoder", "M2M100ForConditionalGeneration", "M2M100Config", "seq2seq",
                                          **_BART),
    "MBartForCausalLM": _hf("decoder", "MBartForCausalLM", "MBartConfig", **_BART),
    "MegatronBertForCausalLM": _hf("encoder", "MegatronBertForCausalLM", "MegatronBertConfig", **_BERT),
    "MobileBertForMaskedLM": _hf("encoder", "MobileBertForMaskedLM", "MobileBertConfig", **_BERT, embedding_size=32,
                                 intra_bottleneck_size=32, true_hidden_size=32, num_feedforward_networks=2),
    "MT5ForConditionalGeneration": _hf("encoder-decoder", "MT5ForConditionalGeneration", "MT5Config", "seq2seq", **_T5),
    "OPTForCausalLM": _hf("decoder", "OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=2, ffn_dim=128, word_embed_proj_dim=64, max_position_embeddings=64),
    "PegasusForCausalLM": _hf("decoder", "PegasusForCausalLM", "PegasusConfig", **_BART),
    "PLBartForCausalLM": _hf("decoder", "PLBartForCausalLM", "PLBartConfig", **_BART),
    "RobertaForCausalLM": _hf("encoder", "RobertaForCausalLM", "RobertaConfig", **_BERT),
    # T5Config() has no decoder start token in transformers 5; t5-small's config ships 0 (its pad token)
    "T5ForConditionalGeneration": _hf("encoder-decoder", "T5ForConditionalGeneration", "T5Config", "seq2seq", **_T5,
                                      decoder_start_token_id=0),
    "T5Small": _hf("encoder-decoder", "T5ForConditionalGeneration", "T5Config", "seq2seq", **_T5,
                   decoder_start_token_id=0),  # t5-small's config is T5Config's defaults
    "TrOCRForCausalLM": _hf("decoder", "TrOCRForCausalLM", "TrOCRConfig", vocab_size=VOCAB, d_model=64, decoder_layers=2,
                            decoder_attention_heads=2, decoder_ffn_dim=128, max_position_embeddings=64),
    "XGLMForCausalLM": _hf("decoder", "XGLMForCausalLM", "XGLMConfig", vocab_size=VOCAB, d_model=64, num_layers=2,
                           attention_heads=2, ffn_dim=128, max_position_embeddings=64),
    "XLNetLMHeadModel": _hf("decoder", "XLNetLMHeadModel", "XLNetConfig", vocab_size=VOCAB, d_model=64, n_layer=2, n_head=2,
                            d_inner=128),
    "YituTechConvBert": _hf("encoder", "ConvBertForMaskedLM", "ConvBertConfig", **_BERT, embedding_size=32),
}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# timm
# ---------------------------------------------------------------------------------------------


def _timm_build(name: str, kwargs: dict) -> nn.Module:
    return timm.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs)


def _timm(family: str, name: str, size: int = 64, **kwargs: object) -> Entry:
    """A model built by its registered name with kwargs its constructor takes."""
    shrink = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    return Entry(family, functools.partial(_timm_build, name, kwargs), "images", size, f"{size}px" + (f", {shrink}" if shrink else ""))


def _made(family: str, size: int, shrink: str, make: Callable[..., nn.Module], *args: object, **kwargs: object) -> Entry:
    """A model whose registered function fixes the kwargs that shrink it (widths, depth
    multipliers, a config dataclass): built by the generator or class that function calls."""
    build = functools.partial(make, *args, num_classes=CLASSES, **kwargs)
    return Entry(family, build, "images", size, f"{size}px, {shrink}")


def _nfnet(name: str, **shrink: object) -> nn.Module:
    return nfnet.NormFreeNet(dataclasses.replace(nfnet.model_cfgs[name], **shrink), num_classes=CLASSES)


def _byob(name: str, cfgs: dict, **shrink: object) -> nn.Module:
    return byobnet.ByobNet(dataclasses.replace(cfgs[name], **shrink), num_classes=CLASSES)


_NF_SHRINK = dict(depths=(1, 1, 1, 1), channels=(32, 64, 96, 128), stem_chs=16, group_size=8, num_features=128)
_MOBILEVIT_BLOCKS = (
    mobilevit._inverted_residual_block(d=1, c=16, s=1),
    mobilevit._inverted_residual_block(d=1, c=24, s=2),
    mobilevit._mobilevit_block(d=1, c=32, s=2, transformer_dim=32, transformer_depth=2, patch_size=2),
    mobilevit._mobilevit_block(d=1, c=48, s=2, transformer_dim=48, transformer_depth=1, patch_size=2),
    mobilevit._mobilevit_block(d=1, c=64, s=2, transformer_dim=64, transformer_depth=1, patch_size=2),
)
_VIT = dict(embed_dim=64, depth=2, num_heads=2)
_ONEDNN_CONV1X1 = (
    "torch 2.13 CPU bug: oneDNN's backward of a channels-last 1x1 stride-2 conv from 3 channels (the stem's; Inductor "
    "makes convs channels-last) corrupts memory, in eager too (full-size stem: Conv2d(3, 64, 1, stride=2) at 224 px), "
    "so either run may crash"
)

_TIMM: dict[str, Entry] = {
    # Inception v3's layout is fixed (no width or depth kwargs): only the image shrinks, to 96 px (75 is its minimum)
    "adv_inception_v3": _timm("convnet", "inception_v3", size=96),
    "beit_base_patch16_224": _timm("vit", "beit_base_patch16_224", img_size=64, **_VIT),
    "convnextv2_nano.fcmae_ft_in22k_in1k": _timm("convnet", "convnextv2_nano", depths=(1, 1, 2, 1), dims=(16, 32, 48, 64)),
    "deit_base_distilled_patch16_224": _timm("vit", "deit_base_distilled_patch16_224", img_size=64, **_VIT),
    "deit_tiny_patch16_224.fb_in1k": _timm("vit", "deit_tiny_patch16_224", img_size=64, **_VIT),
    "dm_nfnet_f0": Entry("convnet", functools.partial(_nfnet, "dm_nfnet_f0", **_NF_SHRINK), "images", 64,
                         f"64px, NfCfg {_NF_SHRINK}"),
    "ghostnet_100": _made("nas-se", 64, "width=0.5", ghostnet._create_ghostnet, "ghostnet_100", width=0.5),
    "inception_v3": _timm("convnet", "inception_v3", size=96),
    "mobilenetv2_100": _timm("convnet", "mobilenetv2_100", depth_multiplier=0.34),
    "mobilenetv3_large_100": _timm("nas-se", "mobilenetv3_large_100", depth_multiplier=0.34),
    "mobilevit_s": Entry("vit", functools.partial(_byob, "mobilevit_s", mobilevit.model_cfgs, blocks=_MOBILEVIT_BLOCKS,
                                                  num_features=128), "images", 64,
                         "64px, stages c=16/24/32/48/64, transformer dims 32/48/64, depths 2/1/1, num_features=128"),
    "nfnet_l0": Entry("convnet", functools.partial(_nfnet, "nfnet_l0", **_NF_SHRINK), "images", 64, f"64px, NfCfg {_NF_SHRINK}"),
    "repvgg_a2": Entry("convnet", functools.partial(_byob, "repvgg_a2", byobnet.model_cfgs,
                                                    blocks=byobnet._rep_vgg_bcfg(d=(1, 1, 2, 1), wf=(0.25, 0.25, 0.25, 0.25)),
                                                    stem_chs=16), "images", 64,
                       "64px, depths (1, 1, 2, 1), width factors 0.25, stem_chs=16", known=_ONEDNN_CONV1X1),
    "swin_base_patch4_window7_224": _timm("vit", "swin_base_patch4_window7_224", img_size=64, window_size=4, embed_dim=32,
                                          depths=(2, 2), num_heads=(2, 4)),
    "tf_efficientnet_b0": _made("nas-se", 64, "channel_multiplier=0.25, depth_multiplier=0.34", efficientnet._gen_efficientnet,
                                "tf_efficientnet_b0", channel_multiplier=0.25, depth_multiplier=0.34,
                                bn_eps=efficientnet.BN_EPS_TF_DEFAULT, pad_type="same"),  # as tf_efficientnet_b0() sets
    "visformer_small": _timm("vit", "visformer_small", img_size=64, init_channels=16, embed_dim=64, depth=(1, 1, 1), num_heads=2),
    "vit_base_patch14_dinov2.lvd142m": _timm("vit", "vit_base_patch14_dinov2", size=56, img_size=56, **_VIT),
    "vit_base_patch16_siglip_256": _timm("vit", "vit_base_patch16_siglip_256", img_size=64, **_VIT),
    "mixer_b16_224": _made("mlp-mixer", 64, "num_blocks=2, embed_dim=64", mlp_mixer.MlpMixer, img_size=64, patch_size=16,
                           num_blocks=2, embed_dim=64),
}  # fmt: skip

MODELS: dict[str, Entry] = {**_HF, **_TIMM}
"""Every model of the suite, by its name in PyTorch's lists."""

SKIPS: dict[str, str] = {}
"""Listed models the pinned transformers / timm cannot build, with the reason (none today)."""


def _stages(arch: list[list[str]], act: str, **kwargs: object) -> nn.Module:
    """The first stages of an EfficientNet-family net (timm's block strings), 16 stem channels.
    Shrunk by multipliers instead, the whole network keeps its 7 stages of distinct convs:
    MobileNet-V3's and EfficientNet-B0's cold compiles took a test 2.5-3 minutes each."""
    return efficientnet.EfficientNet(decode_arch_def(arch), num_classes=CLASSES, num_features=64, stem_size=16,
                                     act_layer=get_act_layer(act), **kwargs)  # fmt: skip


_TF_BATCHNORM = functools.partial(nn.BatchNorm2d, eps=efficientnet.BN_EPS_TF_DEFAULT)  # as tf_efficientnet_b0() sets
_TINY_BERT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                  max_position_embeddings=64)  # fmt: skip

TINY: dict[str, Entry] = {
    "tiny-DistilBertForMaskedLM": _hf("encoder", "DistilBertForMaskedLM", "DistilBertConfig", size=16, vocab_size=VOCAB,
                                      dim=32, n_layers=1, n_heads=2, hidden_dim=64, max_position_embeddings=32),
    "tiny-T5Small": _hf("encoder-decoder", "T5ForConditionalGeneration", "T5Config", "seq2seq", size=16, vocab_size=VOCAB,
                        d_model=32, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2,
                        decoder_start_token_id=0),
    "tiny-AllenaiLongformerBase": _hf("long-context", "LongformerForMaskedLM", "LongformerConfig", **_TINY_BERT,
                                      attention_window=8),
    "tiny-deit_tiny_patch16_224.fb_in1k": _timm("vit", "deit_tiny_patch16_224", size=32, img_size=32, embed_dim=32, depth=1,
                                                num_heads=2),
    "tiny-mixer_b16_224": _made("mlp-mixer", 32, "num_blocks=1, embed_dim=32", mlp_mixer.MlpMixer, img_size=32,
                                patch_size=16, num_blocks=1, embed_dim=32),
    # tf_efficientnet_b0's first 2 stages with a 5x5 kernel (squeeze-excite, swish, TF "same" padding) at half width
    "tiny-tf_efficientnet_b0": Entry("nas-se", functools.partial(_stages, [["ds_r1_k3_s1_e1_c8_se0.25"],
                                                                  ["ir_r1_k5_s2_e6_c12_se0.25"]], "swish", pad_type="same",
                                                                 norm_layer=_TF_BATCHNORM),
                                     "images", 32, "32px, the first 2 stages (the second with 5x5 kernels) at half width"),
}  # fmt: skip
"""Further-shrunk models for ``tests/test_model_suite.py``, one of each family but two: one
layer or block per stage, hidden 32, 16 tokens (Longformer 32: windows of 8) or 32 px,
EfficientNet's first two stages. Cold, the eight families cost the test suite 8-41 s each and
145 s together on the 2-core machine (2026-11-27, ``--durations``; Longformer's four graphs,
split at its ``.item()`` calls, the most), which left the whole suite ~20 s under its 12
minutes: the decoder and convnet families run at world 2 under Inductor elsewhere (GPT-2 with
its dropout in ``tests/test_hf_models.py``, ResNet in ``tests/test_zoo.py``), so their tiny
models (GPT-2, MobileNetV2's first two stages: 25 s) were dropped here."""


def entry(name: str) -> Entry:
    """The suite's model ``name``, or a test's tiny one."""
    return MODELS[name] if name in MODELS else TINY[name]


# ---------------------------------------------------------------------------------------------
# Data and loss
# ---------------------------------------------------------------------------------------------


def batch(name: str, size: int) -> Batch:
    """The fixed global batch of ``size`` examples for model ``name`` (the same every step)."""
    entry_ = entry(name)
    g = torch.Generator().manual_seed(1000)
    if entry_.inputs == "images":
        return {"x": torch.randn(size, 3, entry_.size, entry_.size, generator=g), "y": torch.randint(0, CLASSES, (size,), generator=g)}
    tokens = torch.randint(6, VOCAB, (size, entry_.size), generator=g)  # above every config's special tokens
    if entry_.inputs == "classify-tokens":
        return {"input_ids": tokens, "labels": torch.randint(0, 2, (size,), generator=g)}
    return {"input_ids": tokens, "labels": tokens.clone()}  # causal LMs shift labels themselves; seq2seq shifts them in


def loss(model: nn.Module, b: Batch) -> torch.Tensor:
    """Cross-entropy of the images' classes, or the Hugging Face model's own loss."""
    if "x" in b:
        return F.cross_entropy(model(b["x"]), b["y"])
    return model(**b).loss
