"""The dump directory, TORCH_TRACE artifacts, and no fxzero log lines unless asked."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.fx as fx

import fxzero
import fxzero.passes
from fxzero.backend import BackendOptions
from fxzero.passes.param_gather_wait import param_gather_wait_pass
from fxzero.dump import DUMP_DIR_ENV, resolve_dump_dir


def _train_once(**options: Any) -> None:
    """Compile a two-bucket MLP with fxzero and run one forward+backward."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    config = fxzero.Config(bucket_size=32, overlap_param_gather=True)  # the forward gets its waits
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, config=config, module=model)
    compiled = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager", **options})
    compiled(torch.randn(2, 4)).sum().backward()
    opt.zero_grad()


def _load_module(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem.replace(".", "_"), path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dump_dir_files_exist_load_and_summarize_the_buckets(tmp_path: Path) -> None:
    _train_once(dump_dir=str(tmp_path))
    index = json.loads((tmp_path / "summary.json").read_text())
    (entry,) = index["graphs"]
    stem = entry["stem"]
    assert stem == entry["graph_id"].replace("/", "_") and re.fullmatch(r"\d+_\d+", stem), entry
    assert entry["kinds"] == ["backward", "forward", "joint"] and entry["buckets"] == [[0, 0], [0, 1]]
    for kind in ("joint", "forward", "backward"):
        for stage in ("before", "after"):
            path = tmp_path / f"{stem}_{kind}_{stage}.py"
            module = _load_module(path)  # import-loads: valid Python with its imports
            assert any(isinstance(v, type) and issubclass(v, torch.nn.Module) for v in vars(module).values())
        diff = (tmp_path / f"{stem}_{kind}.diff").read_text()
        assert diff.startswith(f"--- {stem}_{kind}_before.py\n+++ {stem}_{kind}_after.py\n")
    joint_diff = (tmp_path / f"{stem}_joint.diff").read_text()
    assert re.search(r"^\+ +grads_ready_default\b.* = torch\.ops\.fxzero\.grads_ready\.default\(", joint_diff, re.M)
    # after partitioning, the launch tokens leave the backward's outputs: autograd gets None
    assert "+        return (None, None, None, None, None)" in (tmp_path / f"{stem}_backward.diff").read_text()
    summary = json.loads((tmp_path / entry["summary"]).read_text())
    assert [(b["index"], b["params"], b["numel"], b["padded_numel"]) for b in summary["buckets"]] == [
        (0, ["2.weight", "2.bias"], 21, 128),
        (1, ["0.weight", "0.bias"], 30, 128),
    ]
    inserted = {kind: [(n["op"], n["bucket"]) for n in part["inserted"]] for kind, part in summary["graphs"].items()}
    launches = [("fxzero::grads_ready", 0), ("fxzero::grads_ready", 1)]
    assert inserted == {"joint": launches, "forward": [("fxzero::wait_params", 1), ("fxzero::wait_params", 0)], "backward": launches}
    assert summary["graphs"]["forward"]["files"] == [f"{stem}_forward_before.py", f"{stem}_forward_after.py"]


def _noop_pass(gm: fx.GraphModule, example_inputs: Any, **kwargs: Any) -> fx.GraphModule:
    return gm


def test_env_var_dump_dir_with_a_file_per_pass_when_several_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DUMP_DIR_ENV, str(tmp_path))
    with mock.patch.object(fxzero.passes, "FORWARD_PASSES", (param_gather_wait_pass, _noop_pass)):
        _train_once()
    (stem,) = {p.name[:3] for p in tmp_path.glob("*_forward_after.py")}
    forward = sorted(p.name for p in tmp_path.glob(f"{stem}_forward*"))
    assert forward == [
        f"{stem}_forward.diff",
        f"{stem}_forward_after.py",
        f"{stem}_forward_before.py",
        f"{stem}_forward_pass1_param_gather_wait_pass.py",
        f"{stem}_forward_pass2__noop_pass.py",
    ]
    diff = (tmp_path / f"{stem}_forward.diff").read_text()
    assert f"+++ {stem}_forward_pass1_param_gather_wait_pass.py" in diff
    assert diff.endswith(f"\n# {stem}_forward_pass2__noop_pass.py: no change\n")
    assert sorted(p.name for p in tmp_path.glob(f"{stem}_backward*")) == [
        f"{stem}_backward.diff",
        f"{stem}_backward_after.py",
        f"{stem}_backward_before.py",
    ]


def test_dump_dir_option_wins_over_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DUMP_DIR_ENV, str(tmp_path / "env"))
    assert resolve_dump_dir(str(tmp_path / "option")) == tmp_path / "option"
    assert resolve_dump_dir(None) == tmp_path / "env"
    monkeypatch.setenv(DUMP_DIR_ENV, "")
    assert resolve_dump_dir(None) is None
    with pytest.raises(TypeError, match="fxzero option 'dump_dir' must be a path"):
        BackendOptions.from_mapping({"dump_dir": 3})


class _Artifacts(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, Any] = {}

    def emit(self, record: logging.LogRecord) -> None:
        artifact = getattr(record, "metadata", {}).get("artifact")
        if artifact is not None and artifact["name"].startswith("fxzero_"):
            self.seen[artifact["name"]] = (artifact["encoding"], record.payload)  # type: ignore[attr-defined]


def test_trace_structured_artifacts_and_no_log_lines_without_torch_logs(capfd: pytest.CaptureFixture[str]) -> None:
    from torch._logging._internal import trace_log

    handler = _Artifacts()
    trace_log.addHandler(handler)
    try:
        _train_once()
    finally:
        trace_log.removeHandler(handler)
    (stem,) = {re.match(r"fxzero_\d+_\d+", name).group(0) for name in handler.seen}  # type: ignore[union-attr]
    for kind in ("joint", "forward", "backward"):
        assert handler.seen[f"{stem}_{kind}_after"][0] == "string"
        assert "torch.ops.fxzero" in handler.seen[f"{stem}_{kind}_after"][1]
        assert handler.seen[f"{stem}_{kind}_diff"][1].startswith("--- ")
    for kind, op in (("joint", "grads_ready"), ("forward", "wait_params")):  # where fxzero's ops go in
        assert f"torch.ops.fxzero.{op}" not in handler.seen[f"{stem}_{kind}_before"][1]
    encoding, payload = handler.seen[f"{stem}_summary"]
    assert encoding == "json" and len(json.loads(payload)["buckets"]) == 2
    # TORCH_LOGS is not set in this process: fxzero's INFO lines stay silent.
    assert "fxzero graph" not in capfd.readouterr().err
    assert torch._logging._internal.log_registry.is_log("fxzero")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_one_graph_id_names_the_dump_files_the_log_lines_the_warnings_and_explain(tmp_path: Path) -> None:
    """A graph has one id (Dynamo's compile id, fxzero keeps no counter): its dump files and
    index entry, its INFO lines, fxzero's warnings about it and explain's "graph N" all say it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    compiled = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager", "dump_dir": str(tmp_path / "run")})
    logger, lines = logging.getLogger("fxzero.dump"), _Lines()  # on the logger itself: torch's log setup may stop propagation
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        with pytest.warns(UserWarning) as caught:
            compiled(torch.randn(2, 4))  # no optimizer yet: the graph compiles unmanaged
            opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, module=model)
            compiled(torch.randn(2, 4)).sum().backward()  # read by an optimizer built after it compiled
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    (entry,) = json.loads((tmp_path / "run" / "summary.json").read_text())["graphs"]
    graph = entry["graph_id"]
    assert (tmp_path / "run" / f"{graph.replace('/', '_')}_forward_after.py").exists()
    messages = [str(w.message) for w in caught]
    assert any(f"the trainable params of compiled graph {graph} are not managed" in m for m in messages), messages
    assert any(f"compiled graph {graph} read params of a DistributedOptimizer before the optimizer existed" in m for m in messages), messages
    assert any(line.startswith(f"fxzero graph {graph} forward: ") for line in lines.lines), lines.lines
    opt.zero_grad()
    text = fxzero.explain(model, torch.randn(2, 4), optimizer=opt, inner_compiler="eager", dump_dir=tmp_path / "explain")
    (entry,) = json.loads((tmp_path / "explain" / "summary.json").read_text())["graphs"]
    assert re.findall(r"^graph (\S+): ", text, re.M) == [entry["graph_id"]] and entry["graph_id"] != graph, text


def test_no_dumper_is_built_unless_something_asks_for_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Describing every graph costs compile time: a GraphDumper exists only for a dump dir,
    TORCH_TRACE, the fxzero INFO log or a recorder."""
    import fxzero.dump

    from torch._logging._internal import trace_log

    monkeypatch.delenv(DUMP_DIR_ENV, raising=False)
    logger = logging.getLogger("fxzero")
    with mock.patch.object(fxzero.dump, "GraphDumper", wraps=fxzero.dump.GraphDumper) as built:
        # pytest >= 9.2 attaches its log capture to every logger that does not propagate, torch's
        # structured-trace log among them: a handler there means a trace is wanted, to torch and fxzero
        with mock.patch.object(logger, "level", logging.WARNING), mock.patch.object(trace_log, "handlers", []):
            _train_once()
        assert built.call_count == 0
        _train_once(dump_dir=str(tmp_path))
        assert built.call_count > 0
