"""``fxzero explain`` and ``fxzero parity`` on stock Hugging Face GPT-2, BERT and T5 (built from
their default configs, dropout on; ``hf_targets.py``) at world 2, as a user runs them: no wrapper
(the tools read the ``ModelOutput``), dict batches (the forward's keyword arguments). parity
compares the dropout models exactly (each rank's slice with its rank's generator) and names the
param of a deliberately broken GPT-2; explain flags GPT-2's single default bucket, whose
reduce-scatter launches at the end of backward. The eager inner compiler, but for GPT-2's parity
check under Inductor: its ranks and noise floor compile the dropouts as eager's (``fallback_random``),
so they draw the reference's masks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fxzero.cli import main

TARGETS = Path(__file__).resolve().parent / "hf_targets.py"


@pytest.mark.slow
@pytest.mark.models
@pytest.mark.parametrize("name", ["gpt2", "bert", "t5"])
def test_explain_reads_the_model_output_and_flags_no_overlap(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "explain.json"
    argv = ["explain", f"{TARGETS}:explain_{name}", "--world-size", "2", "--inner-compiler", "eager", "--json", str(data)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    exposed = json.loads(data.read_text())["exposed"]
    assert [e["bucket"] for e in exposed] == [0]  # one default bucket: 40M elements hold the whole model
    flag = exposed[0]
    assert flag["share"] == 1.0 and flag["node"] >= 0.9 * flag["nodes"]
    assert f"no overlap: bucket 0 (100% of the param elements) launches its reduce_scatter at node {flag['node']} of" in out
    assert f"Fix: a smaller bucket, e.g. --bucket-size {flag['suggested_bucket_size']}" in out


@pytest.mark.slow
@pytest.mark.models
@pytest.mark.parametrize(("name", "inner"), [("gpt2", "inductor"), ("bert", "eager"), ("t5", "eager")])
def test_parity_passes_on_dropout_models(name: str, inner: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["parity", f"{TARGETS}:{name}", "--world-size", "2", "--inner-compiler", inner, "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "each rank's slice with that rank's generator" in out  # the dropout was found and drawn per rank
    assert out.splitlines()[-1].startswith("verdict: PASS: ")


@pytest.mark.slow
@pytest.mark.models
def test_parity_names_the_param_of_a_broken_gpt2(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["parity", f"{TARGETS}:broken_gpt2", "--world-size", "2", "--inner-compiler", "eager", "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 1, out
    # ln_f.bias starts at 0, so the bug's gradient (0.2 * bias on rank 1) is 0 until step 1 has moved it
    assert "1 param(s) differ by more than" in out and "first 'transformer.ln_f.bias' (from step 2)" in out.splitlines()[-1]
