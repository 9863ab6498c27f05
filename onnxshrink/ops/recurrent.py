"""Recurrent layers: LSTM, GRU and RNN. Hidden units are the channels.

Unit j of a layer owns row g * hidden + j of W and R for each of its G gates (LSTM 4: i, o, f,
c; GRU 3: z, r, h; RNN 1), the same rows of both halves of B (Wb, Rb), of the peepholes P
(LSTM), column j of R (what every unit reads of it at the previous step), index j of the
initial states and of the outputs Y, Y_h, Y_c. `hidden_size` is one attribute for every
direction, so a kept unit is kept in each direction (one index set for the hidden axis).

A unit stays when a kept output reads it, or when a kept unit reads it through R (the closure
is taken to a fixpoint). A unit whose W, R and B rows (and peepholes, initial states) are all
zero, under the default activations, is exactly zero at every step: sigmoid(0) gates times
tanh(0) = 0 candidates keep its cell and hidden state at 0 (GRU: h = z * h_prev = 0; RNN:
tanh(0) = 0; other activations that map 0 to 0 alike, and a cell clip). It is a constant its
readers absorb, and what it reads through R is not needed.
Input features no kept unit reads (W columns zero), or that are zero, go.

An RNN forgets its initial state: such a unit is h_t = f(0) = 0 for every t >= 1 whatever h_0
is, so when its column of R is zero too (no unit reads h_0[u]) its initial state may be anything,
a graph input included, as long as every sequence has a step (no sequence_lens, or a constant
one >= 1: where a length is 0, Y_h is the initial state in onnxruntime). A zero unit is then
needed by no one: the rewrite reads the kept units of an initial state that holds more (a
Gather), and writes exact zeros where an output keeps a removed unit (the graph's interface: the
RNN's output padded by one zero, gathered in place).

An LSTM's cell and a GRU's state do not forget: they decay from theirs. At zero W, R, B and
peephole rows every gate is f(0) = a (Sigmoid: 0.5) and the candidate g(0) = 0, so a GRU unit is
h_t = (1 - a) g(0) + a h_{t-1} = a h_{t-1} and an LSTM unit c_t = a c_{t-1} + a g(0) = a c_{t-1},
h_t = a h(c_t). With its column of R zero too (no unit reads its state, so an LSTM's h_0 is read
by no one), its states have a closed form in the step t and X's sequence length T: after e steps
the state is a^e s_0, e = t + 1 forward at step t, T - t reverse (it runs from the end), T for
the last states: Y_h = a^T h_0 (GRU), Y_c = a^T c_0 and Y_h = a h(a^T c_0) (LSTM), Y = a^e s_0
(GRU), a h(a^e c_0) (LSTM). Such a decaying unit (`decaying_units`) is needed by no one: the
rewrite gathers the kept units of the states and writes the closed form where an output keeps a
removed unit (a graph output, or a reader that needs it), beside the zeros of zero units: T is
Shape(X) at run time, Y's steps a Range (opset 11: below, a unit Y's kept readers read stays),
a^e s_0 is computed in float64 (a^e underflows float32 after 149 halvings while a^e c_0 of a
large c_0 does not) and cast once. It is onnxruntime's output bit for bit where that is a
normal float: its sigmoid(0) is exactly 0.5, so its float multiplications by 0.5 are exact down
to float's normal range; h is Tanh or Relu, whose ONNX op gives onnxruntime's kernel's values
(checked on 10^-3..10^38 cells, T up to 300). Below it, each of its halvings rounds once (one
denormal step, 1.4e-45, off the single rounding) and its tanh of a denormal is coarse (cells
one step apart give outputs 1.43e-43 apart). Refused, the unit kept with the reason
(`carried_because`): another gate activation than Sigmoid (its powers would not be exact),
another output activation, input_forget. A sequence_lens gives each sequence b its own T_b
(sequence_lens[b]) and Y 0 past it, as onnxruntime writes it (the spec says nothing of Y there);
where a length may be 0 the last states are no step's (onnxruntime writes 0, the spec says
nothing), so they are written only under a constant sequence_lens of lengths >= 1.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import cast

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.core import (
    ConstInfo,
    ConstView,
    Dims,
    Handler,
    InputTypes,
    KeepView,
    OpNode,
    Quantized,
    Reader,
    Reason,
    RewriteView,
    WeightAxes,
    int_attr,
    register,
    str_attr,
)
from onnxshrink.ops.common import along
from onnxshrink.ops.oracle import OracleCase, declare_cases, needs, sig, zero_rows

# Axis roles (layout 0, the default: sequence first; layout 1: batch first): X (seq, batch,
# feature), Y (seq, dir, batch, hidden), states (dir, batch, hidden).
_SEQUENCE_FIRST = {"x": (0, 1, 2), "y": (0, 1, 2, 3), "state": (0, 1, 2)}
_BATCH_FIRST = {"x": (1, 0, 2), "y": (1, 2, 0, 3), "state": (1, 0, 2)}


#: the removed decaying units an output keeps, and what writes their closed form there
_Closed = tuple[np.ndarray, Callable[[int, np.ndarray], gs.Tensor]]

# Activations that map 0 to 0 whatever their alpha (ONNX's recurrent activation names)
_ZERO_AT_ZERO = frozenset({"tanh", "relu", "leakyrelu", "thresholdedrelu", "elu", "softsign", "scaledtanh"})
#: LSTM output activations a closed form applies as the ONNX op (onnxruntime's kernel gives its values)
_CLOSED_OUTPUT = {"tanh": "Tanh", "relu": "Relu"}
_F64 = np.dtype(np.float64)
_NONE = np.zeros(0, bool)  # no units: the key of what every closed form shares


class _Recurrent(Handler):
    gates = 1
    #: activations per direction (RNN f; GRU f, g; LSTM f, g, h) and those the state passes
    activation_count: int = 1
    state_activations: tuple[int, ...] = (0,)
    peepholes = False
    #: a unit whose gate rows are zero forgets its initial state after one step (RNN: h_t =
    #: f(0) = 0 for t >= 1 whatever h_0 is); LSTM's cell and GRU's state decay from theirs
    forgets_state = False
    #: LSTM's cell and GRU's state decay from theirs instead, by a = f(0) a step (f the gates'
    #: activation: Sigmoid, 0.5): its states have a closed form in the initial state (`closed_form`)
    decays_state = False
    #: the initial state the decay starts from (LSTM: initial_c; GRU: initial_h), and the
    #: outputs with a closed form (Y; LSTM: Y_h, Y_c; GRU: Y_h)
    decay_source = 5
    #: names of the default activations of one direction
    default_names: tuple[str, ...] = ("Tanh",)
    #: state inputs ([dirs, batch, hidden], or [batch, dirs, hidden] with layout 1)
    state_inputs: tuple[int, ...] = (5,)

    #: the axes of W and R holding the gate rows (G blocks of hidden) and R's recurrent axis
    #: (the unit each column reads); LSTM's layout: W [dirs, G * hidden, input]
    rows_axis, column_axis = 1, 2
    #: W's axis of the input features
    features_axis = 2

    def input_dims(self, node: OpNode, dims: Callable[[str], Sequence[int | None] | None]) -> Mapping[int, Mapping[int, int]]:
        """X's feature axis (2, in either layout) is W's input size; the initial states'
        direction and hidden axes are W's direction count and `hidden_size` (from a static W)."""
        w = dims(node.inputs[1]) if node.has_input(1) else None
        if w is None or len(w) != 3:
            return {}
        out: dict[int, dict[int, int]] = {}
        if w[self.features_axis]:
            out[0] = {2: int(cast(int, w[self.features_axis]))}
        h = int_attr(node, "hidden_size", 0)
        dirs_axis = 1 if int_attr(node, "layout", 0) else 0
        for i in self.state_inputs:
            if node.has_input(i):
                state = {dirs_axis: int(w[0])} if w[0] else {}
                out[i] = {**state, 2: h} if h > 0 else state
        return out

    def weight_axes(self, node: OpNode, i: int, rank: int) -> WeightAxes | None:
        """W and R: gate rows out, inputs in (stored as the ONNX op reads them: the gates of a
        framework's weights are reordered and its two biases concatenated, so no framework
        layout is claimed); B and P: per-row vectors."""
        if i in (1, 2) and rank == 3:
            return WeightAxes(self.rows_axis, self.column_axis, "recurrent")
        if (i == 3 or (self.peepholes and i == 7)) and rank == 2:
            return WeightAxes(1, None, "vector")
        return None

    def macs(self, node: OpNode, inputs: Sequence[list[int] | None], output: list[int]) -> int:
        """Every step of every sequence: the input and recurrent products of every gate."""
        x, w, r = (inputs[i] if i < len(inputs) else None for i in range(3))
        if x is None or w is None or r is None or len(x) != 3:
            return 0
        return x[0] * x[1] * (int(np.prod(w)) + int(np.prod(r)))

    # -------------------------------------------------------------- structure
    def axes(self, node: gs.Node) -> dict[str, tuple[int, ...]]:
        """Axis roles: X (seq, batch, feature), Y (seq, dir, batch, hidden), states (dir,
        batch, hidden)."""
        return _BATCH_FIRST if int(node.attrs.get("layout", 0)) else _SEQUENCE_FIRST

    def tie_steps(
        self,
        node: gs.Node,
        ks: KeepView,
        roles: dict[str, tuple[int, ...]],
        states: list[gs.Tensor | None],
        p_t: gs.Tensor | None,
    ) -> list[tuple[gs.Tensor, tuple[int, ...]]]:
        """What the recurrence ties: every step feeds the next (the sequence axis keeps every
        index), the directions stay, the batch passes through to the outputs and states. Each
        output with its axis roles."""
        x, wt, rt, bt = node.inputs[0], node.inputs[1], node.inputs[2], ir.present(node, 3)
        xs, xb, _ = roles["x"]
        time = Reason("structure", node.name, node.op, "every step feeds the next")
        ks.pin(x, xs, time)
        for t in (wt, rt, bt, p_t):
            if t is not None:
                ks.pin(t, 0)  # directions
        outs = [(t, roles["y"] if k == 0 else roles["state"]) for k, t in enumerate(node.outputs)]
        for t, role in outs:
            if ir.rank(t) != len(role):
                ks.pin(t)
                continue
            ks.couple(x, xb, t, role[-2])  # batch
            ks.pin(t, role[-3])  # directions
            if len(role) == 4:
                ks.pin(t, role[0], time)
        for t in states:
            if t is not None and ir.rank(t) == 3:
                ks.couple(x, xb, t, roles["state"][1])
                ks.pin(t, roles["state"][0])
            elif t is not None:
                ks.pin(t)
        return outs

    def weights(self, node: gs.Node, reader: Reader) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int] | None:
        """(W, R, B or None, hidden size) when W and R (and B) are constants of the layout."""
        read = _constant_weights(node, reader)
        if read is None:
            return None
        w, r, b, h = read
        g = self.gates
        if w.ndim != 3 or r.shape != (w.shape[0], g * h, h) or w.shape[1] != g * h:
            return None
        if b is not None and b.shape != (w.shape[0], 2 * g * h):
            return None
        return read

    def rows(self, units: np.ndarray, copies: int) -> np.ndarray:
        """Unit mask -> mask of the rows of `copies` stacked blocks (gates)."""
        return np.tile(units, copies)

    def tie_units(
        self,
        node: gs.Node,
        ks: KeepView,
        h: int,
        outs: list[tuple[gs.Tensor, tuple[int, ...]]],
        states: list[gs.Tensor | None],
        state_axis: int,
    ) -> None:
        """For the coupled groups (keeps nothing): hidden unit j is one unit in every direction
        (hidden_size is one attribute), made of row g * hidden + j of W and R for each gate, of
        both halves of B and of the peepholes, R's column j, index j of the initial states
        and of Y, Y_h, Y_c. All are tied to R's column j. An RNN that forgets its initial state
        (`forgets`) leaves out the states computed in the graph (a graph input: the rewrite
        gathers the kept units from it) and the outputs the interface keeps (0 written there);
        an LSTM or GRU whose states have a closed form (`closed_form`) leaves out the computed
        states and the outputs the interface keeps where their closed form is written
        (`closed_outputs`)."""
        rt = node.inputs[2]
        g = self.gates

        def tie(t: gs.Tensor | None, axis: int, n: int) -> None:
            if t is not None and ir.rank(t) is not None and axis < ir.known_rank(t) and ks.size(t, axis) == n:
                idx = np.arange(n)
                ks.unit(rt, self.column_axis, idx % h, t, axis, idx)

        tie(node.inputs[1], self.rows_axis, g * h)
        tie(rt, self.rows_axis, g * h)
        tie(ir.present(node, 3), 1, 2 * g * h)
        tie(ir.present(node, 7) if self.peepholes else None, 1, 3 * h)
        forgets = self.forgets(node, ks)
        decays = not isinstance(self.closed_form(node, ks), str)
        for t in states:  # a zero state (the usual default) is no unit's parameter
            if t is None or ((forgets or decays) and ks.value(t) is None):
                continue  # a computed state a forgetting unit's removal gathers from (`rewrite`)
            c = ks.const(t)
            if c is None or not c.slice_zero(state_axis, h).all():
                tie(t, state_axis, h)
        for k, (t, role) in enumerate(outs):
            if ir.rank(t) != len(role):
                continue
            written = forgets or (decays and self.closed_outputs(node, ks)[min(k, 1)] is None)
            if written and any(r is not None and r.kind == "interface" for r in ks.why(t, role[-1])):
                continue  # the interface keeps its width: a removed unit is written there (0 or its closed form)
            tie(t, role[-1], h)

    def zero_states(self, node: gs.Node, reader: Reader, axis: int, h: int) -> set[int]:
        """The initial-state inputs that are 0 everywhere: ONNX's default when a state is not
        given, so the rewrite may leave them out (a zero state one ConstantOfShape makes for
        several layers keeps every layer's units; as an input it would not fit each layer)."""
        out = set()
        for i in self.state_inputs:
            t = ir.present(node, i)
            c = reader.const(t) if t is not None else None
            if c is not None and ir.rank(t) == 3 and c.slice_zero(axis, h).all():
                out.add(i)
        return out

    def needed_units(
        self, node: gs.Node, ks: KeepView, outs: list[tuple[gs.Tensor, tuple[int, ...]]], r: np.ndarray, h: int
    ) -> np.ndarray:
        """The hidden units kept outputs read, closed under R (what kept units read of it), and
        those a non-zero initial state keeps (another reader of it may need them: its units
        are the layer's)."""
        zero = self.zero_units(node, ks)
        zero = np.zeros(h, bool) if zero is None else zero
        decaying = self.decaying_units(node, ks)
        free = zero | (decaying if decaying is not None else False)
        # a zero unit is needed by no one: the rewrite gathers the states' kept units and
        # writes 0 where an output keeps a removed one; a decaying unit alike, its closed form
        # written there (every step of Y, the last states)
        need = self.state_units(node, ks, self.axes(node)["state"][2], h) & ~free
        why_not = self.closed_outputs(node, ks)
        for j, (t, role) in enumerate(outs):
            k = ks.kept(t, role[-1]) if ir.rank(t) == len(role) else None
            if k is not None and len(k) == h:
                need |= k & ~(free if why_not[min(j, 1)] is None else zero)
            elif ks.is_read(t):
                need[:] = True
        reads = (r != 0).reshape(r.shape[0], self.gates, h, h).any(axis=(0, 1))  # [unit, unit it reads]
        while True:
            more = (need | reads[need].any(axis=0)) & ~zero | need
            if (more == need).all():
                break
            need = more
        return need

    def state_units(self, node: gs.Node, ks: KeepView, axis: int, h: int) -> np.ndarray:
        """The units the non-zero initial states keep."""
        need = np.zeros(h, bool)
        zero = self.zero_states(node, ks, axis, h)
        for i in self.state_inputs:
            t = ir.present(node, i)
            k = ks.kept(t, axis) if t is not None and i not in zero and ir.rank(t) == 3 else None
            if k is not None and len(k) == h:
                need |= k
        return need

    def drop_zero_states(self, node: gs.Node, rw: RewriteView, axis: int, h: int) -> None:
        """Leave out the initial states that are 0 everywhere (`zero_states`) and keep other
        units than the layer (their other readers' in a ConstantOfShape several layers slice)."""
        units = rw.kept(node.inputs[2], self.column_axis)
        for i in self.zero_states(node, rw, axis, h):
            kept = rw.kept(node.inputs[i], axis)
            if units is None or kept is None or not np.array_equal(kept, units):
                node.inputs[i] = gs.Variable.empty()

    def default_activations(self, node: gs.Node) -> bool:
        """Does a unit whose gate inputs are all 0 stay at 0? Its state passes through the
        activations at `state_activations` of each direction's list (LSTM's g and h, GRU's g,
        RNN's f), which must map 0 to 0 (the defaults, Tanh, do); the gates' own (Sigmoid) may
        give anything, as they multiply a 0. A cell `clip` bounds inputs that are 0 already."""
        acts = node.attrs.get("activations")
        if not acts:
            return True
        names = [a.decode() if isinstance(a, bytes) else str(a) for a in cast(Sequence[object], acts)]
        n = self.activation_count
        if len(names) % n:
            return False
        return all(names[d * n + p].lower() in _ZERO_AT_ZERO for d in range(len(names) // n) for p in self.state_activations)

    def forgets(self, node: gs.Node, reader: Reader) -> bool:
        """Does a unit with zero gate rows forget its initial state? An RNN under activations
        that map 0 to 0 in every direction: h_t = f(0) = 0 for every step t >= 1, so its Y is
        0 and so is its Y_h, the last step's, when every sequence has a step (`stepped`)."""
        return self.forgets_state and self.default_activations(node) and self.stepped(node, reader)

    def closed_form(self, node: gs.Node, reader: Reader) -> tuple[np.ndarray, str | None] | str:
        """(a per direction, the op of LSTM's output activation h or None) when a unit with zero
        gate rows and R column has its states in closed form (`decaying_units`), else why not.

        Its gates are f(0) = a at every step (W, R, B and peephole rows 0; no unit's R column
        reads it back), its candidate g(0) = 0. GRU: h_t = (1 - a) g(0) + a h_{t-1} = a h_{t-1},
        so Y_h = a^T h_0. LSTM: c_t = a c_{t-1} + a g(0) = a c_{t-1}, h_t = a h(c_t), so Y_c =
        a^T c_0 and Y_h = a h(a^T c_0); h_0 is read by no one. T is X's sequence length in
        either direction (the reverse one also takes T steps). f must be Sigmoid in every
        direction: onnxruntime's sigmoid(0) is exactly 0.5 (checked), so a^T c_0, a power of two
        times c_0, is exact in float64 and rounds once to float (onnxruntime's T halvings in
        float differ only below float's normal range, by one denormal step); h is Tanh or Relu
        (the ONNX op gives onnxruntime's kernel's values: checked bit for bit)."""
        if not self.decays_state:
            return f"{node.op} forgets its state: no closed form needed"
        if int(node.attrs.get("input_forget", 0)):
            return "input_forget couples its input and forget gates"
        if int(node.attrs.get("layout", 0)) not in (0, 1):
            return "an unknown layout"
        dirs = 2 if str_attr(node, "direction", "forward") == "bidirectional" else 1
        acts = node.attrs.get("activations")
        names = (
            [a.decode() if isinstance(a, bytes) else str(a) for a in cast(Sequence[object], acts)]
            if acts
            else list(self.default_names) * dirs
        )
        n = self.activation_count
        if len(names) != n * dirs:
            return f"{len(names)} activations for {dirs} direction(s) of {n}"
        gate = {names[d * n].lower() for d in range(dirs)}
        if gate != {"sigmoid"}:
            return (
                f"its gate activation {'/'.join(sorted(gate))} is not Sigmoid (0.5 at 0, a rate whose "
                "powers the closed form reproduces exactly)"
            )
        out = None
        if self.activation_count == 3:
            hs = {names[d * n + 2].lower() for d in range(dirs)}
            out = _CLOSED_OUTPUT.get(hs.pop()) if len(hs) == 1 else None
            if out is None:
                return "its output activation h is not Tanh or Relu in every direction (the closed form applies it as an op)"
        return np.full(dirs, 0.5), out

    def closed_outputs(self, node: gs.Node, reader: Reader) -> tuple[str | None, str | None]:
        """Why a decaying unit's closed form is not written in Y, and in its last states (None:
        it is). Y's steps are indexed with Range, an op of opset 11; a last state is no step's
        where a sequence_lens holds 0 (`stepped`)."""
        y = None if reader.opset >= 11 else (
            "Y reads it at every step: its closed form indexes the steps with Range (opset 11), "
            f"the model's opset is {reader.opset}"
        )  # fmt: skip
        last = None if self.stepped(node, reader) else (
            "a last state keeps it and sequence_lens may hold 0, where the last states are no step's "
            "(onnxruntime writes 0, the ONNX spec says nothing, its reference evaluator ignores sequence_lens)"
        )  # fmt: skip
        return y, last

    def decaying_units(self, node: gs.Node, reader: Reader) -> np.ndarray | None:
        """LSTM and GRU units with a closed form (`closed_form`): silent (`silent_units`), their
        column of R zero in every direction (no unit reads their state), not zero units (their
        initial states non-zero or not constant); None if unknown."""
        got = self.weights(node, reader)
        if got is None:
            return None
        _, r, _, h = got
        if isinstance(self.closed_form(node, reader), str):
            return np.zeros(h, bool)
        silent, zero = self.silent_units(node, reader), self.zero_units(node, reader)
        if silent is None or zero is None:
            return None
        return np.asarray(silent & ~(r != 0).any(axis=(0, 1)) & ~zero, bool)

    def stepped(self, node: gs.Node, reader: Reader) -> bool:
        """Does every sequence have a step? Where sequence_lens holds a 0, Y_h is no step's
        output: onnxruntime's RNN copies the initial state through a sequence's missing steps
        (its reverse direction's Y_h is the initial state), and its forward one reads before
        Y's first step; its LSTM and GRU write 0 there (Y_h, Y_c and Y: measured), which the
        ONNX spec does not say (its reference evaluator ignores sequence_lens). So: no
        sequence_lens, or a constant one of lengths >= 1. An empty X
        (length 0) is no input of the op: onnxruntime's Y_h then reads outside Y, onnx's
        reference evaluator raises."""
        t = ir.present(node, 4)
        if t is None:
            return True
        lens = reader.value(t)
        return lens is not None and lens.size > 0 and bool((lens >= 1).all())

    def silent_units(self, node: gs.Node, reader: Reader) -> np.ndarray | None:
        """Units whose gate inputs are all zero at every step but for the initial states: their
        W, R and B rows (and peepholes) zero, under activations that keep them at 0; None if
        unknown."""
        got = self.weights(node, reader)
        if got is None:
            return None
        w, r, b, h = got
        g = self.gates
        if not self.default_activations(node) or int(node.attrs.get("input_forget", 0)):
            return np.zeros(h, bool)
        zero = ~(w != 0).any(axis=2).reshape(-1, g, h).any(axis=(0, 1))
        zero &= ~(r != 0).any(axis=2).reshape(-1, g, h).any(axis=(0, 1))
        if b is not None:
            zero &= ~(b != 0).reshape(-1, 2 * g, h).any(axis=(0, 1))
        p_t = ir.present(node, 7) if self.peepholes else None
        if p_t is not None:
            p = reader.value(p_t)
            if p is None:
                return np.zeros(h, bool)
            zero &= ~(p != 0).reshape(-1, 3, h).any(axis=(0, 1))
        return np.asarray(zero, bool)

    def zero_units(self, node: gs.Node, reader: Reader) -> np.ndarray | None:
        """Units exactly zero at every step (see the module docstring); None if unknown. A silent
        unit's initial states must be 0 there, or, when it forgets them (`forgets`), unread:
        its column of R zero in every direction (no unit reads h[u] at step 1)."""
        zero = self.silent_units(node, reader)
        got = self.weights(node, reader)
        if zero is None or got is None:
            return None
        _, r, _, h = got
        unread = ~(r != 0).any(axis=(0, 1)) if self.forgets(node, reader) else np.zeros(h, bool)
        axis = self.axes(node)["state"][2]
        for i in self.state_inputs:
            t = ir.present(node, i)
            if t is None:
                continue
            c = reader.const(t)
            zero &= (c.slice_zero(axis, h) if c is not None else False) | unread
        return zero

    # -------------------------------------------------------------- forward
    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        zero = self.zero_units(node, ctx)
        if zero is None or not zero.any():
            return None
        roles = self.axes(node)
        outs: list[ConstInfo | None] = []
        for k, t in enumerate(node.outputs):
            r = ir.rank(t)
            hid = roles["y"][3] if k == 0 else roles["state"][2]
            if r is None or hid >= r:
                outs.append(None)
                continue
            dtype = t.dtype if t.dtype is not None else np.float32
            outs.append(ConstInfo(along(zero, hid, r), np.zeros((1,) * r, np.dtype(dtype))))
        return outs

    # -------------------------------------------------------------- backward
    def keep(self, node: gs.Node, ks: KeepView) -> None:
        got = self.weights(node, ks)
        x = node.inputs[0]
        if got is None or ir.rank(x) != 3:
            ks.barrier(node, Reason("barrier", node.name, node.op, "weights or shapes unknown"))
            return
        w, r, b, h = got
        roles = self.axes(node)
        xf = roles["x"][2]
        wt, rt, bt = node.inputs[1], node.inputs[2], ir.present(node, 3)
        for t in (x, wt, rt, bt):
            ks.demand(t, pin=False)
        states = [ir.present(node, i) for i in self.state_inputs]
        p_t = ir.present(node, 7) if self.peepholes else None
        for t in [*states, p_t]:
            ks.demand(t, pin=False)
        for i, t in enumerate(node.inputs):
            if i not in (0, 1, 2, 3, 7 if self.peepholes else -1, *self.state_inputs):
                ks.demand(t if t is not None and t.name else None)  # sequence_lens
        outs = self.tie_steps(node, ks, roles, states, p_t)
        self.tie_units(node, ks, h, outs, states, roles["state"][2])
        need = self.needed_units(node, ks, outs, r, h)
        self.keep_carriers(node, ks, need, outs)
        self.keep_decay_sources(node, ks, outs, need, roles["state"][2])
        why = Reason("structure", node.name, node.op, "a hidden unit keeps its gates, states and outputs")
        for t, role in outs:
            if ir.rank(t) == len(role):
                ks.keep(t, role[-1], need, why)
        ks.keep(wt, 1, self.rows(need, self.gates), why)
        ks.keep(rt, 1, self.rows(need, self.gates), why)
        ks.keep(rt, 2, need, why)
        if bt is not None:
            ks.keep(bt, 1, self.rows(need, 2 * self.gates), why)
        if p_t is not None:
            ks.keep(p_t, 1, self.rows(need, 3), why)
        for t in states:
            if t is not None and ir.rank(t) == 3:
                ks.keep(t, roles["state"][2], need, why)
        ks.couple(x, xf, wt, 2)
        cx = ks.const(x)
        silent = cx.slice_zero(xf, w.shape[2]) if cx is not None else np.zeros(w.shape[2], bool)
        used = (w[:, self.rows(need, self.gates)] != 0).any(axis=(0, 1))
        ks.need(x, xf, used & ~silent)

    def keep_carriers(
        self, node: gs.Node, ks: KeepView, need: np.ndarray, outs: list[tuple[gs.Tensor, tuple[int, ...]]]
    ) -> None:
        """The needed units silent but for their initial states are kept for that reason first
        (what the report says of their zeroed rows): an LSTM's cell and a GRU's state decay from
        theirs (by 0.5 a step at zero gates), which needs its closed form (`closed_form`), and
        a unit's read by the others through its column of R, or in an output its closed form is
        not written in (`closed_outputs`); an RNN's is Y_h where a sequence_lens may be 0."""
        silent = self.silent_units(node, ks)
        got = self.weights(node, ks)
        carry = need & silent if silent is not None else None
        if carry is None or got is None or not carry.any():
            return
        read = (got[1] != 0).any(axis=(0, 1))  # R's columns some unit reads
        for units, how in self.carried_because(node, ks, carry, read, outs):
            if not units.any():
                continue
            why = Reason("structure", node.name, node.op, f"a unit with zero weights carries a non-zero initial state ({how})")
            ks.keep(node.inputs[1], self.rows_axis, self.rows(units, self.gates), why)
            ks.keep(node.inputs[2], self.rows_axis, self.rows(units, self.gates), why)

    def carried_because(
        self,
        node: gs.Node,
        ks: KeepView,
        carry: np.ndarray,
        read: np.ndarray,
        outs: list[tuple[gs.Tensor, tuple[int, ...]]],
    ) -> list[tuple[np.ndarray, str]]:
        """Why units with zero weights still carry their initial state (see `keep_carriers`):
        the units of `carry` (R's columns `read` by some unit, the outputs `outs` keep), each
        with the reason."""
        if self.decays_state:
            decays = f"{node.op}'s state decays from it by 0.5 a step at zero gates, never to 0"
            closed = self.closed_form(node, ks)
            if isinstance(closed, str):
                return [(carry, f"{decays}, and no closed form: {closed}")]
            out = [(carry & read, f"{decays}, and the other units read it at every step, through its column of R")]
            rest = carry & ~read
            for j, why_not in enumerate(self.closed_outputs(node, ks)):
                if why_not is None:
                    continue
                kept = np.zeros(len(carry), bool)
                for t, role in outs[:1] if j == 0 else outs[1:]:
                    k = ks.kept(t, role[-1]) if ir.rank(t) == len(role) else None
                    kept |= k if k is not None and len(k) == len(carry) else ks.is_read(t)
                out.append((rest & kept, f"{decays}, and {why_not}"))
                rest &= ~kept
            return out
        if not self.stepped(node, ks):
            return [(carry, "sequence_lens may hold 0, where Y_h is the initial state, not a step's output")]
        return [(carry, "the other units read it at the first step, through its column of R")]

    def keep_decay_sources(
        self, node: gs.Node, ks: KeepView, outs: list[tuple[gs.Tensor, tuple[int, ...]]], need: np.ndarray, axis: int
    ) -> None:
        """The initial state the closed form of a removed decaying unit reads (`place_outputs`)
        keeps its entries, where an output keeps the unit."""
        src = ir.present(node, self.decay_source) if self.decays_state else None
        placed = self.placed_decaying(node, ks, outs, need)
        if src is None or ir.rank(src) != 3 or placed is None or not placed.any():
            return
        c = ks.const(src)
        if c is not None and c.slice_zero(axis, len(placed))[placed].all():
            return  # zero there: the closed form is 0
        why = Reason("structure", node.name, node.op, "a removed unit's outputs are written from its initial state (a closed form)")
        ks.keep(src, axis, placed, why)

    def placed_decaying(
        self, node: gs.Node, reader: KeepView | RewriteView, outs: list[tuple[gs.Tensor, tuple[int, ...]]], units: np.ndarray
    ) -> np.ndarray | None:
        """The decaying units (`decaying_units`) not among `units` that an output keeps."""
        decaying = self.decaying_units(node, reader) if self.decays_state else None
        if decaying is None:
            return None
        placed = np.zeros(len(decaying), bool)
        why_not = self.closed_outputs(node, reader)
        for j, (t, role) in enumerate(outs):
            if why_not[min(j, 1)] is not None:
                continue
            k = reader.kept(t, role[-1]) if t.name and ir.rank(t) == len(role) else None
            if k is not None and len(k) == len(decaying):
                placed |= k
        return placed & decaying & ~units

    # -------------------------------------------------------------- rewrite
    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        h = int_attr(node, "hidden_size", 0)
        k = rw.kept(node.inputs[2], self.column_axis)
        closed = self.closed_states(node, rw, k) if k is not None else None  # of the inputs as they were
        self.drop_zero_states(node, rw, self.axes(node)["state"][2], h)
        if k is None:
            return
        node.attrs["hidden_size"] = int(k.sum())
        self.gather_states(node, rw, k)
        self.place_outputs(node, rw, k, closed)

    def closed_states(self, node: gs.Node, rw: RewriteView, units: np.ndarray) -> _Closed | None:
        """The removed decaying units an output keeps, and a function of (output, units) that
        writes their closed form (`closed_form`, `_DecayForm`) from the initial state as the
        graph gives it; None when there are none (or their initial state is absent or 0 there:
        0 is written)."""
        roles = self.axes(node)
        outs = [(t, roles["y"] if j == 0 else roles["state"]) for j, t in enumerate(node.outputs)]
        placed = self.placed_decaying(node, rw, outs, units)
        src = ir.present(node, self.decay_source) if self.decays_state else None
        closed = self.closed_form(node, rw)
        if placed is None or not placed.any() or src is None or isinstance(closed, str):
            return None
        axis = roles["state"][2]
        c = rw.const(src)
        if c is not None and c.slice_zero(axis, len(placed))[placed].all():
            return None
        kept = rw.kept(src, axis)
        form = _DecayForm(node, rw, roles, src, np.ones(len(placed), bool) if kept is None else kept, *closed)
        return placed, form.write

    def gather_states(self, node: gs.Node, rw: RewriteView, units: np.ndarray) -> None:
        """An initial state that keeps more than the kept units (a graph input, the removed
        units' entries unread: `zero_units`) is read through a Gather of the kept units. A state
        whose hidden axis has no kept set (its size unknown to shape inference: a zero state
        Tiled to a batch read at run time, as paddle2onnx writes) is whole: the op's own
        hidden_size wide, every unit of it kept."""
        axis = self.axes(node)["state"][2]
        for i in self.state_inputs:
            t = ir.present(node, i)
            if t is None or ir.rank(t) not in (None, 3):
                continue
            kept = rw.kept(t, axis) if ir.rank(t) == 3 else None
            kept = np.ones(len(units), bool) if kept is None else kept
            if np.array_equal(kept, units):
                continue
            assert not (units & ~kept).any(), f"{node.name}: a kept unit's initial state went"
            idx = np.searchsorted(np.flatnonzero(kept), np.flatnonzero(units)).astype(np.int64)
            node.inputs[i] = rw.add_node(
                "Gather", [t, rw.constant(idx, "kept_units")], f"{t.name}_kept_units", {"axis": axis}, dtype=t.dtype
            )

    def place_outputs(
        self, node: gs.Node, rw: RewriteView, units: np.ndarray, closed: _Closed | None = None
    ) -> None:
        """An output that keeps removed units (a graph output or a reader keeps them) gets them
        back: zero units as exact zeros (the node's output padded by one zero on the hidden
        axis), decaying units as their closed form (`closed_states`, joined on
        the hidden axis after the pad), then gathered in the kept order; dynamic batch and
        sequence sizes are left as they run."""
        roles = self.axes(node)
        for j, t in enumerate(node.outputs):
            hid = roles["y"][3] if j == 0 else roles["state"][2]
            r = ir.rank(t)
            kept = rw.kept(t, hid) if t.name and r is not None and hid < r else None
            if r is None or kept is None or np.array_equal(kept, units):
                continue
            assert not (units & ~kept).any(), f"{node.name}: a kept unit's output went"
            removed = kept & ~units
            decayed = removed & closed[0] if closed is not None else np.zeros(len(units), bool)
            zeros = removed & ~decayed
            n = int(units.sum())
            where = np.zeros(len(units), np.int64)
            where[units] = np.arange(n)
            where[zeros] = n  # the pad
            first = n + int(zeros.any())
            where[decayed] = first + np.arange(int(decayed.sum()))
            idx = where[kept]
            rw.insert_after(node, j, "Gather", [rw.constant(idx, "unit_places")], "units_placed", "placed", {"axis": hid})
            if decayed.any():
                assert closed is not None
                form = closed[1](j, decayed)
                rw.insert_after(node, j, "Concat", [form], "units_decayed", "decayed", {"axis": hid})
            if not zeros.any():
                continue
            pads = np.zeros(2 * r, np.int64)
            pads[r + hid] = 1
            if rw.opset >= 11:
                rw.insert_after(node, j, "Pad", [rw.constant(pads, "unit_pad")], "units_padded", "units")
            else:
                rw.insert_after(node, j, "Pad", [], "units_padded", "units", {"pads": pads.tolist()})


@register("LSTM")
class LSTM(_Recurrent):
    gates = 4
    activation_count, state_activations = 3, (1, 2)
    peepholes = True
    state_inputs = (5, 6)
    decays_state, decay_source = True, 6
    default_names = ("Sigmoid", "Tanh", "Tanh")


@register("GRU")
class GRU(_Recurrent):
    gates = 3
    activation_count, state_activations = 2, (1,)
    decays_state, decay_source = True, 5
    default_names = ("Sigmoid", "Tanh")


@register("RNN")
class RNN(_Recurrent):
    gates = 1
    forgets_state = True


@register("DynamicQuantizeLSTM", domain="com.microsoft")
class DynamicQuantizeLSTM(_Recurrent):
    """onnxruntime's LSTM on integer weights (quantize_dynamic writes it for LSTM): X, W [dirs,
    input, 4 * hidden] and R [dirs, hidden, 4 * hidden] (integers, transposed from LSTM's), B,
    sequence_lens, initial_h, initial_c, P, then W's and R's scale and zero point ([dirs] per
    tensor, or [dirs, 4 * hidden] per column). Gates i, o, f, c as LSTM's.

    At run time the kernel quantizes X (each direction's whole sequence) and every step's hidden
    state with a scale and zero point from their minimum and maximum (0 always in the range), so
    every element of them counts: a unit goes only when it is zero at every step (its W and R
    columns at their zero points, B, P and initial states 0: then each product adds nothing and
    its gates are those of the float LSTM's zero unit), and an input feature only where X is
    zero (a live unit, or a nonzero feature, no kept unit reads would still move the range)."""

    types_unknown_to_inference = True

    def output_types(self, node: OpNode, inputs: InputTypes) -> list[tuple[Dims | None, int] | None] | None:
        """LSTM's Y, Y_h, Y_c of X [seq, batch, input] and W [dirs, ...]; X's type."""
        x, w = inputs.known_dims(0), inputs.known_dims(1)
        h = int_attr(node, "hidden_size", 0)
        return [(dims, inputs.dtype(0)) for dims in ([x[0], w[0], x[1], h], [w[0], x[1], h], [w[0], x[1], h])]

    gates = 4
    activation_count, state_activations = 3, (1, 2)
    peepholes = True
    state_inputs = (5, 6)
    param_slots = (8, 9, 10, 11)
    rows_axis, column_axis = 2, 1
    features_axis = 1

    def quantized_input(self, node: OpNode, i: int, rank: int) -> Quantized | None:
        """W and R: (q - zero point) * scale, per direction ([dirs]) or per column ([dirs,
        4 * hidden]); W's scale and zero point at 8 and 9, R's at 10 and 11."""
        if i not in (1, 2) or rank != 3:
            return None
        scale, zp = (8, 9) if i == 1 else (10, 11)
        return Quantized((scale,), zp if node.has_input(zp) else None, 0, axes=(0, 2))

    def weights(self, node: gs.Node, reader: Reader) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int] | None:
        """As the float LSTM's, in this op's layout (W [dirs, input, 4h], R [dirs, h, 4h])."""
        read = _constant_weights(node, reader)
        if read is None:
            return None
        w, r, b, h = read
        if w.ndim != 3 or w.shape[2] != 4 * h or r.shape != (w.shape[0], h, 4 * h):
            return None
        if b is not None and b.shape != (w.shape[0], 8 * h):
            return None
        return w, r, b, h

    def live(self, node: gs.Node, reader: Reader, slot: int, zp_slot: int) -> np.ndarray | None:
        """[dirs, rows, 4 * hidden]: where the integer weight at `slot` is off its zero point."""
        w, t = reader.value(node.inputs[slot]), ir.present(node, zp_slot)
        zp = reader.value(t) if t is not None else np.zeros((), np.int64)
        if w is None or zp is None:
            return None
        zp = zp.astype(np.int64)
        shaped = zp.reshape(-1, 1, 1) if zp.ndim == 1 else zp.reshape(zp.shape[0], 1, -1)
        return np.asarray(np.not_equal(w.astype(np.int64), shaped if zp.ndim else zp))

    def zero_units(self, node: gs.Node, reader: Reader) -> np.ndarray | None:
        got = self.weights(node, reader)
        w_live, r_live = self.live(node, reader, 1, 9), self.live(node, reader, 2, 11)
        if got is None or w_live is None or r_live is None:
            return None
        _, _, b, h = got
        if not self.default_activations(node) or int(node.attrs.get("input_forget", 0)):
            return np.zeros(h, bool)
        zero = ~w_live.any(axis=(0, 1)).reshape(4, h).any(axis=0)
        zero &= ~r_live.any(axis=(0, 1)).reshape(4, h).any(axis=0)
        if b is not None:
            zero &= ~(b != 0).reshape(-1, 8, h).any(axis=(0, 1))
        p_t = ir.present(node, 7)
        if p_t is not None:
            p = reader.value(p_t)
            if p is None:
                return np.zeros(h, bool)
            zero &= ~(p != 0).reshape(-1, 3, h).any(axis=(0, 1))
        for i in self.state_inputs:
            t = ir.present(node, i)
            if t is not None:
                c = reader.const(t)
                zero &= c.slice_zero(2, h) if c is not None else False
        return np.asarray(zero, bool)

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        got, zero = self.weights(node, ks), self.zero_units(node, ks)
        x = node.inputs[0]
        if got is None or zero is None or ir.rank(x) != 3:
            ks.barrier(node, Reason("barrier", node.name, node.op, "weights or shapes unknown"))
            return
        w, _, _, h = got
        wt, rt, bt, p_t = node.inputs[1], node.inputs[2], ir.present(node, 3), ir.present(node, 7)
        states = [ir.present(node, i) for i in self.state_inputs]
        for t in (x, wt, rt, bt, p_t, *states):
            ks.demand(t, pin=False)
        outs = self.tie_steps(node, ks, _SEQUENCE_FIRST, states, p_t)  # the op has no layout attribute
        self.tie_units(node, ks, h, outs, states, 2)
        ks.demand(ir.present(node, 4))  # sequence_lens
        why = Reason(
            "normalization", node.name, node.op,
            "its hidden state is quantized at every step with a range from every unit (only units "
            "zero at every step do not count)",
        )  # fmt: skip
        need = ~zero | self.state_units(node, ks, 2, h)
        for k, t in enumerate(node.outputs):  # and the zero units a kept output reads whole
            kept = ks.kept(t, ir.known_rank(t) - 1) if ir.rank(t) == (4 if k == 0 else 3) else None
            if kept is not None and len(kept) == h:
                need |= kept
            elif ks.is_read(t):
                need[:] = True
        rows = self.rows(need, self.gates)
        for k, t in enumerate(node.outputs):
            if ir.rank(t) == (4 if k == 0 else 3):
                ks.keep(t, ir.known_rank(t) - 1, need, why)
        ks.keep(wt, 2, rows, why)
        ks.keep(rt, 2, rows, why)
        ks.keep(rt, 1, need, why)
        if bt is not None:
            ks.keep(bt, 1, self.rows(need, 2 * self.gates), why)
        if p_t is not None:
            ks.keep(p_t, 1, self.rows(need, 3), why)
        for t in states:
            if t is not None and ir.rank(t) == 3:
                ks.keep(t, 2, need, why)
        for slot in self.param_slots:  # per column: [dirs, 4 * hidden], sliced with the rows
            t = ir.present(node, slot)
            if t is not None and ir.rank(t) == 2 and ks.size(t, 1) == 4 * h:
                ks.demand(t, pin=False)
                ks.pin(t, 0)
                ks.keep(t, 1, rows, why)
                ks.unit(rt, 1, np.arange(4 * h) % h, t, 1, np.arange(4 * h))
            else:
                ks.demand(t)
        ks.couple(x, 2, wt, 1)
        cx = ks.const(x)
        silent = cx.slice_zero(2, w.shape[1]) if cx is not None else np.zeros(w.shape[1], bool)
        ks.keep(
            x, 2, ~silent,
            Reason("normalization", node.name, node.op, "X is quantized with a range from every "
                   "element (only zeros do not count)"),
        )  # fmt: skip


class _DecayForm:
    """Writes the closed form of removed decaying units (`_Recurrent.closed_states`) into the
    graph, each piece once. Step t's state is a^e s_0 with e = t + 1 forward and T - t reverse
    (T: X's sequence length, Shape(X) at run time, or sequence b's length sequence_lens[b], past
    which Y is 0: onnxruntime's, as it writes no step there); the last states' e is T. a^e s_0
    is computed in float64 and cast once; LSTM's outputs are then a h(.) in the state's type,
    as the kernel does."""

    def __init__(
        self,
        node: gs.Node,
        rw: RewriteView,
        roles: dict[str, tuple[int, ...]],
        src: gs.Tensor,
        kept: np.ndarray,
        rates: np.ndarray,
        act: str | None,
    ) -> None:
        self.node, self.rw, self.roles, self.src, self.kept, self.rates, self.act = node, rw, roles, src, kept, rates, act
        self.dtype = np.dtype(src.dtype if src.dtype is not None else np.float32)
        self.lens = ir.present(node, 4)
        direction = str_attr(node, "direction", "forward")
        self.forward = np.array([direction != "reverse"] if direction != "bidirectional" else [True, False])
        self.memo: dict[tuple[str, bytes], gs.Tensor] = {}

    def once(self, key: str, which: np.ndarray, build: Callable[[], gs.Tensor]) -> gs.Tensor:
        k = (key, which.tobytes())
        if k not in self.memo:
            self.memo[k] = build()
        return self.memo[k]

    def cast(self, t: gs.Tensor, to: np.dtype, hint: str) -> gs.Tensor:
        return self.rw.add_node("Cast", [t], hint, {"to": onnx.helper.np_dtype_to_tensor_dtype(to)}, dtype=to)

    def steps(self, wide: bool) -> gs.Tensor:
        """X's sequence length T: an int64 scalar, or float64 (`wide`)."""
        def build() -> gs.Tensor:
            shape = self.rw.add_node("Shape", [self.node.inputs[0]], "decay_x_shape", dtype=np.int64)
            seq = self.rw.constant(np.asarray(self.roles["x"][0], np.int64), "seq_axis")
            return self.rw.add_node("Gather", [shape, seq], "decay_steps", {"axis": 0}, dtype=np.int64)
        t = self.once("steps", _NONE, build)
        return self.once("steps_f64", _NONE, lambda: self.cast(t, _F64, "decay_steps_f64")) if wide else t

    def lengths(self, at: int, rank: int, to: np.dtype) -> gs.Tensor:
        """sequence_lens in `to`, along axis `at` (the batch's) of a rank-`rank` output."""
        def build() -> gs.Tensor:
            assert self.lens is not None
            shape = np.ones(rank, np.int64)
            shape[at] = -1
            n = self.cast(self.lens, to, "decay_lengths")
            return self.rw.add_node("Reshape", [n, self.rw.constant(shape, "decay_lengths_shape")], "decay_lengths_along", dtype=to)
        return self.once(f"lengths {at} {rank} {to}", _NONE, build)

    def state(self, which: np.ndarray) -> gs.Tensor:
        """The initial state of the units `which`, in float64 ([dirs, batch, units] by layout)."""
        def build() -> gs.Tensor:
            idx = np.searchsorted(np.flatnonzero(self.kept), np.flatnonzero(which)).astype(np.int64)
            units = self.rw.constant(idx, "decaying_units")
            s0 = self.rw.add_node("Gather", [self.src, units], "decaying_state", {"axis": self.roles["state"][2]}, dtype=self.dtype)
            return self.cast(s0, _F64, "decaying_state_f64")
        return self.once("state", which, build)

    def narrow(self, t: gs.Tensor, hint: str) -> gs.Tensor:
        return t if self.dtype == _F64 else self.cast(t, self.dtype, hint)

    def last(self, which: np.ndarray) -> gs.Tensor:
        """a^T s_0: the last cell (LSTM) or state (GRU)."""
        def build() -> gs.Tensor:
            rate = self.rw.constant(along_axis(self.rates.astype(_F64), self.roles["state"][0]), "decay_rate")
            n = self.steps(True) if self.lens is None else self.lengths(self.roles["state"][1], 3, _F64)
            power = self.rw.add_node("Pow", [rate, n], "decay_power", dtype=_F64)
            return self.narrow(self.rw.add_node("Mul", [self.state(which), power], "decayed_f64", dtype=_F64), "decayed")
        return self.once("last", which, build)

    def every(self, which: np.ndarray) -> gs.Tensor:
        """a^e s_0 at every step t (e = t + 1 forward, T - t reverse), in Y's layout."""
        rw, i64 = self.rw, np.dtype(np.int64)
        y_seq, y_dirs, y_batch, _ = self.roles["y"]

        def along(values: np.ndarray, at: int, hint: str) -> gs.Constant:
            return rw.constant(along_axis(values, at, 4), hint)

        def build() -> gs.Tensor:
            one, zero = rw.constant(np.asarray(1, np.int64), "one"), rw.constant(np.asarray(0, np.int64), "zero")
            t = rw.add_node("Range", [zero, self.steps(False), one], "decay_step_index", dtype=i64)
            at_seq = np.ones(4, np.int64)
            at_seq[y_seq] = -1
            t = rw.add_node("Reshape", [t, rw.constant(at_seq, "decay_step_shape")], "decay_steps_along_y", dtype=i64)
            # the exponent in int64 (exact; no float constants): t * sign + first + span * T
            sign = along(np.where(self.forward, 1, -1).astype(np.int64), y_dirs, "decay_step_sign")
            first = along(np.where(self.forward, 1, 0).astype(np.int64), y_dirs, "decay_first_step")
            span = along(np.where(self.forward, 0, 1).astype(np.int64), y_dirs, "decay_span")
            n = self.steps(False) if self.lens is None else self.lengths(y_batch, 4, i64)
            e = rw.add_node("Add", [rw.add_node("Mul", [t, sign], "decay_signed_steps", dtype=i64), first], "decay_after", dtype=i64)
            e = rw.add_node("Add", [e, rw.add_node("Mul", [span, n], "decay_ends", dtype=i64)], "decay_exponent", dtype=i64)
            rate = along(self.rates.astype(_F64), y_dirs, "decay_rate")
            power = rw.add_node("Pow", [rate, self.cast(e, _F64, "decay_exponent_f64")], "decay_powers", dtype=_F64)
            to_y = np.empty(4, np.int64)
            to_y[[y_seq, y_dirs, y_batch, 3]] = [1, len(self.rates), -1, int(which.sum())]
            s0 = rw.add_node("Reshape", [self.state(which), rw.constant(to_y, "decay_state_shape")], "decaying_state_along_y", dtype=_F64)
            out = rw.add_node("Mul", [s0, power], "decayed_steps_f64", dtype=_F64)
            if self.lens is not None:  # 0 past a sequence's end (a 0 cast from an integer: no float constant)
                within = rw.add_node("Less", [t, n], "decay_within", dtype=np.bool_)
                out = rw.add_node("Where", [within, out, self.cast(zero, _F64, "decay_zero")], "decayed_within", dtype=_F64)
            return self.narrow(out, "decayed_steps")
        return self.once("every", which, build)

    def write(self, j: int, which: np.ndarray) -> gs.Tensor:
        """Output j's closed form (Y, Y_h, Y_c) of the units `which`."""
        s = self.every(which) if j == 0 else self.last(which)
        if j == 2 or self.act is None:
            return s
        # LSTM's Y and Y_h: a * h(c_t)
        at, rank = (self.roles["y"][1], 4) if j == 0 else (self.roles["state"][0], 3)
        hs = self.rw.add_node(self.act, [s], "decayed_output", dtype=self.dtype)
        rate = self.rw.constant(along_axis(self.rates.astype(self.dtype), at, rank), "decay_rate")
        return self.rw.add_node("Mul", [hs, rate], "decayed_h", dtype=self.dtype)


def along_axis(values: np.ndarray, axis: int, rank: int = 3) -> np.ndarray:
    """A per-direction vector shaped to broadcast along `axis` of a state (rank 3) or Y (rank 4)."""
    shape = [1] * rank
    shape[axis] = len(values)
    return values.reshape(shape)


def _constant_weights(node: gs.Node, reader: Reader) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int] | None:
    """(W, R, B or None, hidden_size) of a recurrent node when W and R (and B, if given) are
    constants and hidden_size is set; their layout is the op's to check."""
    w, r = reader.value(node.inputs[1]), reader.value(node.inputs[2])
    b_t = ir.present(node, 3)
    b = reader.value(b_t) if b_t is not None else None
    h = int(node.attrs.get("hidden_size", 0))
    if w is None or r is None or (b_t is not None and b is None) or h <= 0:
        return None
    return w, r, b, h


# ------------------------------------------------------------------ oracle cases
def _recurrent_case(op: str, rng: np.random.Generator) -> OracleCase:
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    seq, batch, feat, h = int(rng.integers(1, 4)), int(rng.integers(1, 3)), int(rng.integers(2, 5)), int(rng.integers(2, 5))
    dirs = int(rng.integers(1, 3))
    ins = [("x", "float", [seq, batch, feat]), ("W", "float", [dirs, gates * h, feat]),
           ("R", "float", [dirs, gates * h, h]), ("B", "float", [dirs, 2 * gates * h])]  # fmt: skip
    y = [seq, dirs, batch, h]
    direction = "bidirectional" if dirs == 2 else "forward"
    body = f'y, yh = {op} <hidden_size = {h}, direction = "{direction}"> (x, W, R, B)'
    units = zero_rows(rng, h)
    rows = [g * h + u for g in range(gates) for u in units]
    zero = {"R": np.s_[:, :, units]} if rng.random() < 0.5 else {"W": np.s_[:, rows], "R": np.s_[:, rows]}
    return OracleCase(op, sig(ins, [("y", y), ("yh", [dirs, batch, h])]) + f" {{ {body} }}", 17, zero=zero,
                      needs={**needs(rng, "y", y), **needs(rng, "yh", [dirs, batch, h])})


declare_cases(
    dict.fromkeys(("LSTM", "GRU", "RNN"), _recurrent_case),
    excluded={"DynamicQuantizeLSTM": "integer weights only; tests/ops/test_recurrent.py"},
)
