"""`python -m onnxshrink.cli`: the same as the `onnxshrink` command."""

import sys

from onnxshrink.cli import main

sys.exit(main())
