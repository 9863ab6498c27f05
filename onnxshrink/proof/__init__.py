"""The proof: the shrunk model against the reference in onnxruntime, as users run them.

- `verdict`: per output, its error against its tolerance; the report.
- `inputs`: the shapes chosen for dynamic dims, random draws, inputs given in files.
- `sessions`: onnxruntime sessions, levels, threads; a model run whole or in segments.
- `comparison`: the proof itself (`compare`); `judge`: the float64 judge where float32 cannot decide;
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
from onnxshrink.proof.sessions import (
    check_provider,
    check_runnable,
    run_model,
    session,
    session_threads,
)
from onnxshrink.proof.verdict import ErrorTally, OutputCheck, ValidationReport

__all__ = [
    "ErrorTally",
    "OutputCheck",
    "ValidationReport",
    "check_inputs",
    "check_provider",
    "check_runnable",
    "compare",
    "load_inputs",
    "make_inputs",
    "parse_shapes",
    "resolve_shapes",
    "run_model",
    "session",
    "session_threads",
]
