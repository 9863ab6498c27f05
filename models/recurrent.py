"""A small recurrent model with its hidden units as named groups: a bidirectional LSTM, an
LSTM and a GRU, then a Linear on the last step.

Hidden unit i of a layer owns row g * hidden + i of each gate's block in its input and
recurrent weights and biases (both directions of a bidirectional layer: ONNX's hidden_size is
one for both), column i of its recurrent weights, and the columns of the next layer's input
weights that read it (i and hidden + i after a bidirectional layer).
"""

from __future__ import annotations

import numpy as np
from torch import nn

from models.zoo import Entry, Grouped


class Recurrent(Grouped):
    def __init__(self, widths: dict[str, int] | None = None, features: int = 6, classes: int = 3):
        super().__init__(widths or {}, {"lstm0": 8, "lstm1": 8, "gru": 8})
        h0, h1, h2 = self.w("lstm0"), self.w("lstm1"), self.w("gru")
        self.lstm0 = nn.LSTM(features, h0, bidirectional=True, batch_first=True)
        self.lstm1 = nn.LSTM(2 * h0, h1, batch_first=True)
        self.gru = nn.GRU(h1, h2, batch_first=True)
        self.head = nn.Linear(h2, classes)
        for group, layer, gates, dirs in (
            ("lstm0", self.lstm0, 4, ("", "_reverse")),
            ("lstm1", self.lstm1, 4, ("",)),
            ("gru", self.gru, 3, ("",)),
        ):
            h = self.w(group)

            def gate_rows(i, h=h, gates=gates):
                return np.arange(gates) * h + i

            for d in dirs:
                for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                    self.claim(group, layer, f"{p}_l0{d}", 0, gate_rows)
                self.claim(group, layer, f"weight_hh_l0{d}", 1, lambda i: np.array([i]))
        self.claim("lstm0", self.lstm1, "weight_ih_l0", 1, lambda i, h=h0: np.array([i, h + i]))
        self.claim("lstm1", self.gru, "weight_ih_l0", 1, lambda i: np.array([i]))
        self.claim("gru", self.head, "weight", 1, lambda i: np.array([i]))

    def forward(self, x):
        y, _ = self.lstm0(x)
        y, _ = self.lstm1(y)
        y, _ = self.gru(y)
        return self.head(y[:, -1])


RECURRENT = Entry(lambda w=None: Recurrent(w), (2, 5, 6))
