"""Write models/mha/dynamo_{seq_first,batch_first}.onnx: torch.nn.MultiheadAttention (E=16, 4
heads, random biases; models/mha.py) exported by torch's dynamo exporter with a dynamic batch
and sequence axis. The export takes ~13 s, so tests/ops/test_packed_heads_dynamic.py reads the
stored models (the legacy exporter's it exports itself).

    python tools/mha_fixtures.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import mha  # noqa: E402


def main() -> None:
    mha.DIR.mkdir(exist_ok=True)
    for batch_first in (False, True):
        model = mha.export(mha.module(batch_first, biases=True), batch_first, dynamo=True, seq=True)
        model.doc_string = ""
        del model.metadata_props[:]
        for node in model.graph.node:
            del node.metadata_props[:]
        path = mha.fixture_path(batch_first)
        onnx.save(model, path)
        print(f"{path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
