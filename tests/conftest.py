"""Shared fixtures: the committed demo pair, its exports, and small random-init models."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO_PAIR = Path(os.environ.get("EDGESPEC_DEMO_PAIR", REPO / "tools" / "demo_pair"))


@pytest.fixture(scope="session")
def demo_target() -> Path:
    return DEMO_PAIR / "target"


@pytest.fixture(scope="session")
def demo_draft() -> Path:
    return DEMO_PAIR / "draft"


@pytest.fixture(scope="session")
def demo_bundle() -> Path:
    from edgespec.engine import demo_bundle

    return demo_bundle()


@pytest.fixture(scope="session")
def fp32_bundle(tmp_path_factory, demo_target, demo_draft) -> Path:
    """The demo pair exported without quantization: comparable with PyTorch to ~1e-5."""
    from edgespec.export import export

    out = tmp_path_factory.mktemp("fp32") / "bundle"
    export(demo_target, out, draft=demo_draft, precision="fp32")
    return out


@pytest.fixture(scope="session")
def nested_bundle(tmp_path_factory, demo_target) -> Path:
    """BitNest: the demo target's W8 nest with its 4-bit base as the draft, fp32
    activations so that references in PyTorch compare closely."""
    from edgespec.export import export

    out = tmp_path_factory.mktemp("nest") / "bundle"
    export(demo_target, out, draft="nested", accuracy_level=0)
    return out


@pytest.fixture(scope="session")
def engine(demo_bundle):
    import edgespec

    return edgespec.load(demo_bundle)


@pytest.fixture
def bundle_copy(tmp_path, demo_bundle) -> Path:
    """A private copy of the demo bundle that a test may damage."""
    dst = tmp_path / "bundle"
    shutil.copytree(demo_bundle, dst)
    return dst


def torch_model(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def torch_logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].numpy()
