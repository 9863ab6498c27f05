"""The proof: the shrunk model against the reference in onnxruntime, as users run them.

Its surface is the proof itself and what a caller hands it:

- `compare(reference, shrunk, opts)`: run both, each output against its tolerance, the float64
  judge where float32 cannot decide; it returns a `ValidationReport` (one `OutputCheck` per
  output).
- `parse_shapes`, `load_inputs`, `check_inputs`: the shapes and arrays given on the command line;
  `resolve_shapes`, `make_inputs`: the shapes chosen for dynamic dims and the random draws.

The modules, by subject (their other functions are imported from them where needed):

- `verdict`: per output, its error against its tolerance; the report.
- `inputs`: the shapes chosen for dynamic dims, random draws, inputs given in files.
- `sizes`: the sizes of the dynamic dims tried on the input model until it runs.
- `sessions`: onnxruntime sessions, levels, threads; a model run whole or in segments.
- `comparison`: the proof itself (`compare`); `judge`: the float64 judge where float32 cannot decide,
  `widen`: models computed in float64 (whole or in pieces) for it;
  `qdq`: quantized products compared as integer kernels compute them; `emulate`: bfloat16
  emulated in float32; `segment`: cutting a model for memory or for `--validate-layers`.
- `recover`: after a failed proof, the removals responsible kept back by bisection.
"""

from onnxshrink.proof.comparison import compare
from onnxshrink.proof.inputs import (
    check_inputs,
    load_inputs,
    make_inputs,
    parse_shapes,
    resolve_shapes,
)
from onnxshrink.proof.verdict import OutputCheck, ValidationReport

__all__ = [
    "OutputCheck",
    "ValidationReport",
    "check_inputs",
    "compare",
    "load_inputs",
    "make_inputs",
    "parse_shapes",
    "resolve_shapes",
]
