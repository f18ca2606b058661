"""``benchmarks/model_suite.py``: PyTorch's own torch.compile benchmark models trained by fxzero
against DDP + torch.compile. Here: its model list is PyTorch's two lists name for name (each
model built or skipped with a reason), and one further-shrunk model of every family (encoder,
encoder-decoder, ViT, MLP-mixer, NAS net with squeeze-excite; the decoder, convnet and
long-context families are run :data:`ELSEWHERE`) comes out "pass" through the
benchmark's own code: dropout on, 3 SGD steps at world 2, losses and params within the
benchmark's tolerances of the reference's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the ranks copy sys.path when the pool starts
import model_suite  # noqa: E402
import suite_models  # noqa: E402

PYTORCH_HF = """AlbertForMaskedLM AllenaiLongformerBase BartForCausalLM BertForMaskedLM BigBird BlenderbotForCausalLM
DebertaV2ForMaskedLM DistilBertForMaskedLM DistillGPT2 ElectraForCausalLM GoogleFnet GPT2ForSequenceClassification
LayoutLMForMaskedLM M2M100ForConditionalGeneration MBartForCausalLM MegatronBertForCausalLM MobileBertForMaskedLM
MT5ForConditionalGeneration OPTForCausalLM PegasusForCausalLM PLBartForCausalLM RobertaForCausalLM
T5ForConditionalGeneration T5Small TrOCRForCausalLM XGLMForCausalLM XLNetLMHeadModel YituTechConvBert""".split()
"""pytorch/pytorch ``benchmarks/dynamo/huggingface_models_list_cpu.txt``."""

PYTORCH_TIMM = """adv_inception_v3 beit_base_patch16_224 convnextv2_nano.fcmae_ft_in22k_in1k deit_base_distilled_patch16_224
deit_tiny_patch16_224.fb_in1k dm_nfnet_f0 ghostnet_100 inception_v3 mobilenetv2_100 mobilenetv3_large_100 mobilevit_s
nfnet_l0 repvgg_a2 swin_base_patch4_window7_224 tf_efficientnet_b0 visformer_small vit_base_patch14_dinov2.lvd142m
vit_base_patch16_siglip_256""".split()
"""pytorch/pytorch ``benchmarks/dynamo/timm_models_list.txt`` (names only)."""

FAMILIES = ("encoder", "decoder", "encoder-decoder", "long-context", "convnet", "vit", "mlp-mixer", "nas-se")


def test_model_list_is_pytorchs_lists_name_for_name_each_built_or_skipped_with_a_reason() -> None:
    assert model_suite.names("hf") == PYTORCH_HF
    assert model_suite.names("timm") == [*PYTORCH_TIMM, "mixer_b16_224"]
    for name in model_suite.names("all"):
        assert (name in suite_models.MODELS) != (name in suite_models.SKIPS), name
        assert suite_models.SKIPS.get(name, "reason").strip(), f"{name}: a skip needs its reason"
    assert {e.family for e in suite_models.MODELS.values()} == set(FAMILIES)


ELSEWHERE = {
    "decoder": "test_hf_models.py (GPT-2, dropout on, Inductor)",
    "convnet": "test_zoo.py (timm ResNet, Inductor)",
    # its tiny case (tiny-AllenaiLongformerBase, still in suite_models.TINY) took 50 s of the suite's 12 minutes
    "long-context": "benchmarks/results/model_suite-2026-11-27.md (AllenaiLongformerBase: pass)",
}
"""Families whose world-2 Inductor case is run elsewhere (see ``suite_models.TINY``)."""

HERE = [name for name, e in suite_models.TINY.items() if e.family not in ELSEWHERE]


def test_tiny_models_cover_every_family() -> None:
    assert sorted({suite_models.TINY[name].family for name in HERE} | set(ELSEWHERE)) == sorted(FAMILIES)
    assert not {suite_models.TINY[name].family for name in HERE} & set(ELSEWHERE)


@pytest.fixture(scope="module")
def suite():
    with model_suite.Suite() as s:  # a pool of its own: its ranks see benchmarks/ on sys.path
        yield s


@pytest.mark.slow
@pytest.mark.models
@pytest.mark.parametrize("name", HERE)
def test_family_representative_trains_like_ddp_compile(suite: model_suite.Suite, name: str) -> None:
    row = model_suite.run_model(name, suite.run, timeout=300)
    assert row.cls == "pass", (row.note, row.loss_diff, row.param_diff, row.trace)
    assert row.buckets >= 2 and row.moved > 100 * model_suite.PARAM_TOL  # several buckets; SGD moved the params
