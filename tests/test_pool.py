"""The shared thread pool (edgespec.runtimes.pool): a process-wide choice, so each case
runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper
from edgespec.runtimes import pool
if sys.argv[1] == "shared":
    pool.share_threads()
import edgespec
engine = edgespec.load(None, device="cpu", threads=2)
ids = engine.tokenizer.encode("def fibonacci(n):")
texts = {mode: engine.generate(ids, max_new_tokens=24, temperature=0, mode=mode).token_ids
         for mode in ("ar", "spec")}
x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
app = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "app",
                                          [x], [y]),
                        opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
def runs(opts):
    try:
        s = ort.InferenceSession(app, opts, providers=["CPUExecutionProvider"])
        return s.run(None, {"x": np.array([-1.0, 2.0], np.float32)})[0].tolist() == [0.0, 2.0]
    except Exception as e:
        return str(e).splitlines()[0][-80:]
own = ort.SessionOptions()
own.intra_op_num_threads = 1
print(json.dumps({"texts": texts, "joined": runs(pool.session_options(1)), "own": runs(own)}))
"""


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    out = {}
    for kind in ("shared", "own"):
        done = subprocess.run([sys.executable, "-c", SCRIPT, kind], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        out[kind] = json.loads(done.stdout.splitlines()[-1])
    return out


def test_the_pool_does_not_change_what_is_generated(runs):
    shared, own = runs["shared"]["texts"], runs["own"]["texts"]
    assert len(shared["ar"]) == 24
    assert shared == own
    assert shared["spec"] == shared["ar"]


def test_sessions_made_with_edgespecs_options_run_beside_its_engine(runs):
    assert runs["shared"]["joined"] is True
    assert runs["own"]["joined"] is True


def test_a_pool_of_its_own_fails_beside_the_shared_pool_and_runs_by_default(runs):
    """Why the library shares only when told (pool.py)."""
    assert "global thread pool" in runs["shared"]["own"]
    assert runs["own"]["own"] is True
