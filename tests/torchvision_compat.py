"""Make ``import torchvision`` survive a torchvision whose C extension cannot load.

Why this exists
---------------
The test suite pins the CPU build ``torch==2.13.0+cpu``.  The only torchvision
release for torch 2.13 is ``torchvision==0.28.0`` and its wheel is a CUDA
build: ``torchvision/_C.so`` links ``libc10_cuda.so``/``libtorch_cuda.so``,
which a CPU torch does not ship.  torchvision tolerates that
(``torchvision.extension._has_ops()`` becomes False and the other meta
registrations are skipped) *except* for two unconditional calls in
``torchvision/_meta_registrations.py``::

    @torch.library.register_fake("torchvision::nms")
    @torch.library.register_fake("torchvision::qnms")

They need the operator schemas, which normally come from ``_C.so``, so
``import torchvision`` dies with ``RuntimeError: operator torchvision::nms
does not exist``.  Everything that imports torchvision dies with it: ``timm``
(``timm/layers/create_norm.py`` imports ``torchvision.ops.misc``) and
``transformers`` models such as ``BertForMaskedLM`` (its image utilities
import torchvision when it is installed).

What it does
------------
``ensure_torchvision_importable()`` imports torchvision.  Only if that fails
because an operator schema is missing *and* torchvision itself reports that
its C extension did not load (``torchvision.extension._has_ops()`` is False),
it defines the schemas that are missing -- nothing else, no kernels -- in a
``FRAGMENT`` library and imports torchvision again.  The schemas are copied
from torchvision's ``csrc/ops/nms.cpp`` and
``csrc/ops/quantized/cpu/qnms_kernel.cpp``.  ``torchvision.ops.nms`` still
raises torchvision's own "Couldn't load custom C++ ops" error, exactly as it
would without the shim.

Call it before anything imports torchvision, timm or transformers (top of
``conftest.py``).  Called later it still repairs torchvision, since a failed
``import torchvision`` leaves nothing half-registered behind.

Safety
------
* The decision is torchvision's own ``_has_ops()``, not a guess at the
  extension's file name (torchvision 0.29 renamed ``_C`` to ``_C_stable``).
  This matters: if a schema defined here were later defined again by a
  loading extension, the C++ library registration would abort the process
  (``std::terminate``), not raise.
* No-op when torchvision is absent, when it imports normally (CUDA torch, or
  a torchvision matching the torch build), and on every later call:
  idempotent, never defines a schema twice.
* ``FRAGMENT`` rather than ``DEF``, so the ``torchvision`` namespace is not
  claimed; the ``Library`` object is kept in a module global because a
  garbage-collected ``Library`` drops its definitions.
"""

from __future__ import annotations

import importlib.util
import sys
import threading

__all__ = ["ensure_torchvision_importable"]

# Exact schemas from pytorch/vision (v0.28):
#   torchvision/csrc/ops/nms.cpp
#   torchvision/csrc/ops/quantized/cpu/qnms_kernel.cpp
_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}

_LOCK = threading.Lock()
_LIBRARY = None  # the FRAGMENT, kept alive; stays None unless it was needed


def _op_exists(name: str) -> bool:
    import torch

    try:
        torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
    except RuntimeError:
        return False
    return True


def ensure_torchvision_importable() -> bool:
    """Import torchvision, defining the nms/qnms schemas first if it needs them.

    Returns True when the schemas had to be defined (now or by an earlier
    call), False when torchvision is absent or imported without help.
    Exceptions other than the missing-schema failure propagate unchanged.
    """
    global _LIBRARY
    with _LOCK:
        if _LIBRARY is not None:
            return True
        if "torchvision" in sys.modules:
            return False
        if importlib.util.find_spec("torchvision") is None:
            return False
        try:
            import torchvision  # noqa: F401
        except RuntimeError as error:
            extension = sys.modules.get("torchvision.extension")
            missing = [name for name in _SCHEMAS if not _op_exists(name)]
            if (
                extension is None
                or extension._has_ops()
                or not missing
                or "torchvision::" not in str(error)
            ):
                raise
        else:
            return False

        import torch

        library = torch.library.Library("torchvision", "FRAGMENT")
        for name in missing:
            library.define(_SCHEMAS[name])
        _LIBRARY = library
        import torchvision  # noqa: F401,F811  (retry; a second failure propagates)

        return True
