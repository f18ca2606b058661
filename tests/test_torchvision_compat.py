"""The test environment's torchvision shim (``tests/torchvision_compat.py``): timm and
transformers import next to the CPU torch, and the shim acts only where torchvision's C
ops did not load."""

from __future__ import annotations

import torch

import torchvision_compat


def test_torchvision_timm_and_transformers_import_and_the_shim_acts_only_without_c_ops() -> None:
    import timm
    import torchvision
    from transformers import BertForMaskedLM  # failed in this environment without the shim

    assert timm.create_model("resnet10t", pretrained=False, num_classes=2) is not None and BertForMaskedLM
    helped = torchvision_compat.ensure_torchvision_importable()
    assert helped == (not torchvision.extension._has_ops())  # defined schemas only where the C ops did not load
    assert torchvision_compat.ensure_torchvision_importable() == helped  # idempotent: nothing defined twice
    assert torch._C._dispatch_has_kernel_for_dispatch_key("torchvision::nms", "CPU") == torchvision.extension._has_ops()
