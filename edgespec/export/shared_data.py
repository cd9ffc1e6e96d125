"""One copy on disk of a weight two graphs of a bundle both hold.

A draft head gathers its token embeddings from the very codes the target holds (its
tied LM head or its embedding table): for Gemma 3's 262k-token vocabulary that table
is most of the model. Its bytes are found by content in the target's external data
file and the draft's tensor is pointed there; the draft's own data file keeps the rest.
ONNX Runtime reads an external tensor from any file next to the graph.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import onnx
from onnx.external_data_helper import ExternalDataInfo

MIN_SHARED = 1 << 16  # bytes: smaller tensors are not worth a reference into another file


def _external(tensor: onnx.TensorProto, folder: Path) -> tuple[str, bytes] | None:
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    info = ExternalDataInfo(tensor)
    with open(folder / info.location, "rb") as f:
        f.seek(info.offset or 0)
        return info.location, f.read(info.length)


def _point(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)


def share_weights(folder: Path, graph: str, source: str) -> list[str]:
    """Point `graph`'s large external tensors at identical bytes in `source`'s data file
    and rewrite `graph`'s own data file without them. Returns the data files `graph`
    reads now."""
    theirs = onnx.load(folder / source, load_external_data=False)
    where: dict[str, tuple[str, int, int]] = {}
    for t in theirs.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = ExternalDataInfo(t)
            if info.length and info.length >= MIN_SHARED:
                where.setdefault(hashlib.sha256(_external(t, folder)[1]).hexdigest(),
                                 (info.location, info.offset or 0, info.length))
    model = onnx.load(folder / graph, load_external_data=False)
    own = f"{graph}.data"
    chunks: list[bytes] = []
    offset = 0
    files = {own}
    for t in model.graph.initializer:
        found = _external(t, folder)
        if found is None:
            continue
        _, data = found
        shared = where.get(hashlib.sha256(data).hexdigest()) if len(data) >= MIN_SHARED \
            else None
        if shared:
            _point(t, *shared)
            files.add(shared[0])
        else:
            _point(t, own, offset, len(data))
            chunks.append(data)
            offset += len(data)
    tmp = folder / f"{own}.part"
    tmp.write_bytes(b"".join(chunks))
    tmp.replace(folder / own)
    onnx.save_model(model, folder / graph)
    return sorted(files)
