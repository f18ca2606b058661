"""The compat package across torch versions: the range it supports is pyproject's and the
docs', and each older-torch branch (2.11, the build the GPU machines carry, where
``tests/test_cuda.py`` runs) is checked here on 2.13 by giving it the older API's shape."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from torch._inductor import config as inductor_config
from torch._inductor import custom_graph_pass

import fxzero
from fxzero import _torch_compat as compat
from fxzero._torch_compat import inductor as compat_inductor

from models import MLP


class _CountingPass(custom_graph_pass.CustomGraphPass):
    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: fx.Graph) -> None:
        self.graphs += 1

    def uuid(self) -> bytes:
        return b"test-counting-pass"


@pytest.mark.slow
def test_a_users_post_grad_pass_still_runs_beside_fxzeros_under_inductor() -> None:
    """fxzero adds its post-grad pass to the user's; it must not replace it."""
    torch._dynamo.reset()
    user_pass = _CountingPass()
    model = MLP()
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, module=model)
    with inductor_config.patch(post_grad_custom_post_pass=user_pass, fx_graph_cache=False):
        torch.compile(model, backend="fxzero")(torch.randn(4, 16)).sum().backward()
        assert inductor_config.post_grad_custom_post_pass is user_pass
    opt.step()
    assert user_pass.graphs == 2  # the forward and the backward


def test_older_torch_takes_one_post_grad_pass_and_a_users_own_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11 has no ``get_custom_graph_passes`` and takes one pass: fxzero's alone, or an
    error naming the setting, never the user's pass silently dropped."""
    ours, user_pass = _CountingPass(), _CountingPass()
    assert compat_inductor._chained(user_pass, ours) == (user_pass, ours)
    monkeypatch.delattr(custom_graph_pass, "get_custom_graph_passes")
    assert compat_inductor._chained(None, ours) is ours
    with pytest.raises(RuntimeError, match=r"post_grad_custom_post_pass is set .*unset it, or use torch>=2.13"):
        compat_inductor._chained(user_pass, ours)


def test_inductor_config_extra_gets_what_the_torch_version_takes() -> None:
    """2.13 reads the Dynamo graph (its cudagraph annotation); 2.11 takes Inductor's config."""
    gm = fx.symbolic_trace(MLP())

    def new_style(gm: object) -> None: ...

    def old_style(config: object) -> None: ...

    assert compat_inductor._config_extra_arg(new_style, gm) is gm
    assert compat_inductor._config_extra_arg(old_style, gm) is inductor_config


ROOT = Path(__file__).resolve().parents[1]


def _release(text: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def test_the_supported_torch_range_is_pyprojects_and_the_docs_say_it() -> None:
    """``TORCH_VERSIONS`` is pyproject's requirement, the README and CONTRIBUTING state it, the
    torch running here is inside it, and every release the compat package names (its
    version branches) lies inside it, the oldest included: a branch for a release outside the
    range is dead code, and a range without its oldest release's branches a false promise."""
    low, high = re.fullmatch(r">=(\d+\.\d+),<(\d+\.\d+)", compat.TORCH_VERSIONS).groups()  # type: ignore[union-attr]
    inside = lambda release: _release(low) <= release < _release(high)  # noqa: E731
    requirement = f"torch{compat.TORCH_VERSIONS}"
    assert f'"{requirement}"' in (ROOT / "pyproject.toml").read_text()
    assert f"`{requirement}`" in (ROOT / "README.md").read_text()
    assert f"`{requirement}`" in (ROOT / "CONTRIBUTING.md").read_text()
    assert inside(_release(torch.__version__))
    parts = [path for path in Path(compat.__file__).parent.glob("*.py") if path.name != "__init__.py"]
    named = {_release(m) for path in parts for m in re.findall(r"\b2\.\d+\b", path.read_text())}
    assert named and all(map(inside, named)) and _release(low) in named


def _pins(name: str) -> dict[str, str]:
    lines = (ROOT / name).read_text().splitlines()
    return dict(line.split("==", 1) for line in lines if "==" in line and not line.startswith("#"))


def test_a_torch_outside_the_range_is_refused_at_import_in_one_sentence() -> None:
    """Not a failure deep inside a compile: ``import fxzero`` itself refuses, naming the range and
    the newest release verified (the pin of CI's second environment, the top of the range)."""
    import subprocess
    import sys

    assert compat.NEWEST_VERIFIED == _pins("constraints-torch2.15.txt")["torch"]
    newest = _release(compat.NEWEST_VERIFIED)
    assert compat.TORCH_VERSIONS.endswith(f"<{newest[0]}.{newest[1] + 1}")
    for inside in ("2.11.0", "2.13.0+cpu", "2.14.1", "2.15.0+cu132", torch.__version__):
        assert compat.unsupported_torch_message(inside) is None, inside
    for outside in ("2.10.1", "2.16.0", "2.16.0.dev20261201+cpu", "3.0.0"):
        message = compat.unsupported_torch_message(outside)
        assert message is not None and message.count(". ") == 0 and message.endswith("."), message
        assert f"torch{compat.TORCH_VERSIONS}" in message and compat.NEWEST_VERIFIED in message and outside in message
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", "import torch; torch.__version__ = '2.16.0'; import fxzero"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1] == f"ImportError: {compat.unsupported_torch_message('2.16.0')}"


def test_the_recompile_limit_holds_inside_its_context_and_is_restored_after_it_even_on_error() -> None:
    """``recompile_limit`` sets Dynamo's per-function limit directly (cheaper than ``config.patch`` on the
    per-run path of the compiled update) and must leave the user's setting as it found it."""
    import torch._dynamo

    from fxzero._torch_compat import recompile_limit

    before = torch._dynamo.config.recompile_limit
    with recompile_limit(before + 57):
        assert torch._dynamo.config.recompile_limit == before + 57
    assert torch._dynamo.config.recompile_limit == before
    with pytest.raises(RuntimeError, match="inside"):
        with recompile_limit(3):
            raise RuntimeError("inside")
    assert torch._dynamo.config.recompile_limit == before
