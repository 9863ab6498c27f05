"""Write the exporter fixtures under models/<exporter>/: small CNN, MLP and attention models built
in other frameworks with random, trained-like weights, some channels masked (zeroed in the
weights), exported by the exporters themselves.

Needs the frameworks, which must not live beside the project's torch: a separate environment,

    python3 -m venv /work/venvs/exporters && . /work/venvs/exporters/bin/activate
    pip install tensorflow-cpu tf2onnx spox paddlepaddle paddle2onnx onnxruntime
    python tools/exporter_fixtures.py            # all; or e.g. --only tf2onnx spox

Each fixture `models/<exporter>/<arch>.onnx` has a sidecar `<arch>.json`: the inputs to draw
(shapes, dtype, integer range), the channels masked, and `native_params`: the parameter count of
the same architecture built natively in the framework with only the kept channels and exported
by the same exporter (float and 8-bit tensors, initializers and Constant nodes, in every graph).
tests/test_exporters.py shrinks each fixture with validation off, checks its outputs in
onnxruntime against the fixture as given, and its parameter count against `native_params`.
Not stored: the attention model from tf2onnx and from Keras's export (`--only tf2onnx keras
--arch attention --out DIR` writes them). Both lower Keras's attention einsums to Reshapes whose
merged sizes are ReduceProd/Max of Shape gathers ((batch, heads) merged for a batched MatMul and
split back): the analysis reads them as products and maxima of dims (analyze/shapes.py Prod,
MaxOf), so the masked head goes too and the shrunk model has the native 8809 float parameters
(10182 before); but onnxshrink's report counts their int32 shape constants (5 elements) as
parameters (8814), which tests/test_exporters.py's check of the report would refuse.

Architectures (the same in every framework; "zero" = filter/neuron and its bias zeroed, "const" =
weights zeroed with the bias left, a constant channel the consumer's bias absorbs):
  cnn: conv stem 16 (no bias) + BatchNorm + ReLU; residual block conv1 24 + ReLU, conv2 16, Add;
       depthwise 3x3; 1x1 project 32 + ReLU; global average pool; fc1 20 + ReLU; fc2 5.
       Masked: residual stream channel 7 (BatchNorm scale and shift, conv2's filter and bias),
       conv1 zero {1,4,9,14,20}, project const {3,8,30}, fc1 zero {2,11}.
  mlp: dense 64 + SiLU/GELU/Tanh, dense 48 + ReLU, dense 10. Masked: d1 zero {0,5,17,33,40,63},
       d2 const {1,6,30,47}.
  attention: int token ids [batch, 8] -> embedding 50x32 -> 4-head self-attention (head_dim 8)
       + residual -> LayerNorm -> FFN 64 + ReLU -> 32 + residual -> mean over tokens -> dense 3.
       Masked: head 2 (its V projection and bias, its output-projection rows), FFN zero {3,9,21,40,55}.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

CNN = {"stem": 16, "conv1": 24, "project": 32, "fc1": 20}
CNN_MASK = {"stem": [7], "conv1": [1, 4, 9, 14, 20], "project": [3, 8, 30], "fc1": [2, 11]}
MLP = {"d1": 64, "d2": 48}
MLP_MASK = {"d1": [0, 5, 17, 33, 40, 63], "d2": [1, 6, 30, 47]}
ATT = {"heads": 4, "ffn": 64}
ATT_MASK = {"heads": [2], "ffn": [3, 9, 21, 40, 55]}
HEAD_DIM, D_MODEL, SEQ, VOCAB = 8, 32, 8, 50

MASKS = {"cnn": CNN_MASK, "mlp": MLP_MASK, "attention": ATT_MASK}
FULL = {"cnn": CNN, "mlp": MLP, "attention": ATT}
INPUTS = {
    "cnn": {"shape": [1, 16, 16, 3], "dtype": "float32"},  # NHWC for Keras; NCHW elsewhere
    "mlp": {"shape": [2, 32], "dtype": "float32"},
    "attention": {"shape": [2, SEQ], "dtype": "int32", "range": [0, VOCAB]},
}


def kept(arch: str) -> dict[str, int]:
    """The widths of the model built natively with only the kept channels."""
    return {k: v - len(MASKS[arch].get(k, [])) for k, v in FULL[arch].items()}


def count_params(model: Any) -> int:
    """Float and 8-bit elements of initializers and Constant nodes, in every graph (as
    tests/test_exporters.py counts them)."""
    import onnx
    from onnx import numpy_helper

    kinds = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
             onnx.TensorProto.BFLOAT16, onnx.TensorProto.INT8, onnx.TensorProto.UINT8}

    def graph(g: Any) -> int:
        n = sum(int(np.prod(t.dims)) for t in g.initializer if t.data_type in kinds)
        for node in g.node:
            for a in node.attribute:
                if node.op_type == "Constant" and a.name == "value" and a.t.data_type in kinds:
                    n += int(numpy_helper.to_array(a.t).size)
                if a.type == onnx.AttributeProto.GRAPH:
                    n += graph(a.g)
                n += sum(graph(s) for s in a.graphs)
        return n

    return graph(model.graph)


def trained_like(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
    return (rng.standard_normal(shape) * (1.5 / np.sqrt(max(fan_in, 1)))).astype(np.float32)


# --------------------------------------------------------------------------- Keras (TF backend)


def keras_model(arch: str, w: dict[str, int]) -> Any:
    from tensorflow import keras

    L = keras.layers
    if arch == "cnn":
        x = keras.Input((16, 16, 3), name="image")
        y = L.Conv2D(w["stem"], 3, padding="same", use_bias=False, name="stem")(x)
        y = L.BatchNormalization(name="stem_bn")(y)
        y = L.ReLU()(y)
        r = L.Conv2D(w["conv1"], 3, padding="same", activation="relu", name="conv1")(y)
        r = L.Conv2D(w["stem"], 3, padding="same", name="conv2")(r)
        y = L.Add()([y, r])
        y = L.DepthwiseConv2D(3, padding="same", name="dw")(y)
        y = L.Conv2D(w["project"], 1, activation="relu", name="project")(y)
        y = L.GlobalAveragePooling2D()(y)
        y = L.Dense(w["fc1"], activation="relu", name="fc1")(y)
        y = L.Dense(5, name="fc2")(y)
    elif arch == "mlp":
        x = keras.Input((32,), name="features")
        y = L.Dense(w["d1"], activation="silu", name="d1")(x)
        y = L.Dense(w["d2"], activation="relu", name="d2")(y)
        y = L.Dense(10, name="out")(y)
    else:
        x = keras.Input((SEQ,), dtype="int32", name="tokens")
        e = L.Embedding(VOCAB, D_MODEL, name="embed")(x)
        a = L.MultiHeadAttention(w["heads"], HEAD_DIM, name="mha")(e, e)
        h = L.LayerNormalization(name="ln")(L.Add()([e, a]))
        f = L.Dense(w["ffn"], activation="relu", name="ffn1")(h)
        f = L.Dense(D_MODEL, name="ffn2")(f)
        y = L.GlobalAveragePooling1D()(L.Add()([h, f]))
        y = L.Dense(3, name="head")(y)
    return keras.Model(x, y, name=arch)


def keras_randomize_and_mask(model: Any, arch: str, seed: int, masked: bool = True) -> None:
    from tensorflow import keras

    rng = np.random.default_rng(seed)
    for layer in model.layers:
        ws = layer.get_weights()
        if not ws:
            continue
        new = []
        for i, v in enumerate(ws):
            if isinstance(layer, keras.layers.BatchNormalization):
                new.append(rng.uniform(0.5, 1.5, v.shape).astype(np.float32) if i in (0, 3)
                           else (rng.standard_normal(v.shape) * 0.3).astype(np.float32))
            elif isinstance(layer, keras.layers.LayerNormalization):
                new.append((1 + rng.standard_normal(v.shape) * 0.2).astype(np.float32) if i == 0
                           else (rng.standard_normal(v.shape) * 0.2).astype(np.float32))
            elif v.ndim == 1 or (isinstance(layer, keras.layers.MultiHeadAttention) and i % 2 == 1):
                new.append((rng.standard_normal(v.shape) * 0.2).astype(np.float32))  # biases
            else:
                new.append(trained_like(rng, v.shape, int(np.prod(v.shape[:-1]))))
        layer.set_weights(new)
    if not masked:
        return
    m = MASKS[arch]

    def edit(name: str, fn: Callable[[list[np.ndarray]], None]) -> None:
        layer = model.get_layer(name)
        ws = layer.get_weights()
        fn(ws)
        layer.set_weights(ws)

    if arch == "cnn":
        def stream(ws: list[np.ndarray]) -> None:  # BatchNorm: gamma, beta, mean, variance
            ws[0][m["stem"]] = 0
            ws[1][m["stem"]] = 0
        edit("stem_bn", stream)
        edit("conv2", lambda ws: [ws[0].__setitem__((..., m["stem"]), 0), ws[1].__setitem__(m["stem"], 0)])
        edit("conv1", lambda ws: [ws[0].__setitem__((..., m["conv1"]), 0), ws[1].__setitem__(m["conv1"], 0)])
        edit("project", lambda ws: ws[0].__setitem__((..., m["project"]), 0))  # bias kept: constant
        edit("fc1", lambda ws: [ws[0].__setitem__((..., m["fc1"]), 0), ws[1].__setitem__(m["fc1"], 0)])
    elif arch == "mlp":
        edit("d1", lambda ws: [ws[0].__setitem__((..., m["d1"]), 0), ws[1].__setitem__(m["d1"], 0)])
        edit("d2", lambda ws: ws[0].__setitem__((..., m["d2"]), 0))
    else:
        layer = model.get_layer("mha")
        for sub, axis in ((layer._value_dense, "in"), (layer._output_dense, "out")):
            ws = sub.get_weights()
            if axis == "in":  # kernel [d_model, heads, head_dim], bias [heads, head_dim]
                ws[0][:, m["heads"], :] = 0
                ws[1][m["heads"], :] = 0
            else:  # kernel [heads, head_dim, d_model]
                ws[0][m["heads"], :, :] = 0
            sub.set_weights(ws)
        edit("ffn1", lambda ws: [ws[0].__setitem__((..., m["ffn"]), 0), ws[1].__setitem__(m["ffn"], 0)])


def keras_export(arch: str, w: dict[str, int], path: Path, how: str, seed: int) -> None:
    import tensorflow as tf

    model = keras_model(arch, w)
    # the native model is randomized too: exporters merge equal initializers (zero biases)
    keras_randomize_and_mask(model, arch, seed, masked=w == FULL[arch])
    spec = INPUTS[arch]
    sig = (tf.TensorSpec([None, *spec["shape"][1:]], spec["dtype"], name=model.inputs[0].name),)
    if how == "tf2onnx":
        import tf2onnx

        proto, _ = tf2onnx.convert.from_keras(model, input_signature=sig, opset=17)
        path.write_bytes(proto.SerializeToString())
    else:  # Keras 3's own ONNX export
        model.export(str(path), format="onnx", verbose=False, input_signature=sig)


# --------------------------------------------------------------------------- PaddlePaddle


def paddle_model(arch: str, w: dict[str, int]) -> Any:
    import paddle
    from paddle import nn

    class CNN(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2D(3, w["stem"], 3, padding=1, bias_attr=False)
            self.stem_bn = nn.BatchNorm2D(w["stem"])
            self.conv1 = nn.Conv2D(w["stem"], w["conv1"], 3, padding=1)
            self.conv2 = nn.Conv2D(w["conv1"], w["stem"], 3, padding=1)
            self.dw = nn.Conv2D(w["stem"], w["stem"], 3, padding=1, groups=w["stem"])
            self.project = nn.Conv2D(w["stem"], w["project"], 1)
            self.fc1 = nn.Linear(w["project"], w["fc1"])
            self.fc2 = nn.Linear(w["fc1"], 5)

        def forward(self, x: Any) -> Any:
            y = nn.functional.relu(self.stem_bn(self.stem(x)))
            y = y + self.conv2(nn.functional.relu(self.conv1(y)))
            y = nn.functional.relu(self.project(self.dw(y)))
            y = paddle.mean(y, axis=[2, 3])
            return self.fc2(nn.functional.relu(self.fc1(y)))

    class MLP(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.d1, self.d2, self.out = nn.Linear(32, w["d1"]), nn.Linear(w["d1"], w["d2"]), nn.Linear(w["d2"], 10)

        def forward(self, x: Any) -> Any:
            return self.out(nn.functional.relu(self.d2(nn.functional.gelu(self.d1(x)))))

    class Attention(nn.Layer):  # attention written out (paddle's own needs embed_dim = heads * head_dim)
        def __init__(self) -> None:
            super().__init__()
            h = w["heads"] * HEAD_DIM
            self.embed = nn.Embedding(VOCAB, D_MODEL)
            self.q, self.k, self.v = nn.Linear(D_MODEL, h), nn.Linear(D_MODEL, h), nn.Linear(D_MODEL, h)
            self.o = nn.Linear(h, D_MODEL)
            self.ln = nn.LayerNorm(D_MODEL)
            self.ffn1, self.ffn2 = nn.Linear(D_MODEL, w["ffn"]), nn.Linear(w["ffn"], D_MODEL)
            self.head = nn.Linear(D_MODEL, 3)

        def forward(self, x: Any) -> Any:
            e = self.embed(x)

            def heads(t: Any) -> Any:
                return paddle.transpose(paddle.reshape(t, [0, 0, w["heads"], HEAD_DIM]), [0, 2, 1, 3])

            q, k, v = heads(self.q(e)), heads(self.k(e)), heads(self.v(e))
            a = nn.functional.softmax(paddle.matmul(q, k, transpose_y=True) / float(np.sqrt(HEAD_DIM)), axis=-1)
            a = paddle.reshape(paddle.transpose(paddle.matmul(a, v), [0, 2, 1, 3]), [0, 0, w["heads"] * HEAD_DIM])
            h = self.ln(e + self.o(a))
            h = h + self.ffn2(nn.functional.relu(self.ffn1(h)))
            return self.head(paddle.mean(h, axis=1))

    return {"cnn": CNN, "mlp": MLP, "attention": Attention}[arch]()


def paddle_randomize_and_mask(model: Any, arch: str, seed: int, masked: bool = True) -> None:
    rng = np.random.default_rng(seed)
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if "_bn" in name or name.startswith("ln."):  # scale, shift and BatchNorm statistics
            positive = name.endswith(("weight", "_variance"))
            v = rng.uniform(0.5, 1.5, shape) if positive else rng.standard_normal(shape) * 0.3
        elif len(shape) == 1:
            v = rng.standard_normal(shape) * 0.2
        elif name.startswith("embed"):
            v = rng.standard_normal(shape)
        else:  # Linear [in, out]; Conv [out, in/groups, kh, kw]
            fan_in = shape[0] if len(shape) == 2 else int(np.prod(shape[1:]))
            v = trained_like(rng, shape, fan_in)
        p.set_value(np.asarray(v, dtype=np.float32))
    if not masked:
        return
    m = MASKS[arch]

    def zero(param: Any, index: Any) -> None:
        v = param.numpy()
        v[index] = 0
        param.set_value(v)

    if arch == "cnn":
        zero(model.stem_bn.weight, m["stem"])
        zero(model.stem_bn.bias, m["stem"])
        zero(model.conv2.weight, m["stem"])
        zero(model.conv2.bias, m["stem"])
        zero(model.conv1.weight, m["conv1"])
        zero(model.conv1.bias, m["conv1"])
        zero(model.project.weight, m["project"])
        zero(model.fc1.weight, (slice(None), m["fc1"]))
        zero(model.fc1.bias, m["fc1"])
    elif arch == "mlp":
        zero(model.d1.weight, (slice(None), m["d1"]))
        zero(model.d1.bias, m["d1"])
        zero(model.d2.weight, (slice(None), m["d2"]))
    else:
        cols = [h * HEAD_DIM + j for h in m["heads"] for j in range(HEAD_DIM)]
        zero(model.v.weight, (slice(None), cols))
        zero(model.v.bias, cols)
        zero(model.o.weight, cols)
        zero(model.ffn1.weight, (slice(None), m["ffn"]))
        zero(model.ffn1.bias, m["ffn"])


def paddle_export(arch: str, w: dict[str, int], path: Path, seed: int) -> None:
    import paddle

    model = paddle_model(arch, w)
    paddle_randomize_and_mask(model, arch, seed, masked=w == FULL[arch])
    model.eval()
    spec = INPUTS[arch]
    shape = [None, *spec["shape"][1:]]
    if arch == "cnn":
        shape = [None, 3, 16, 16]
    dtype = "int64" if spec["dtype"] == "int32" else spec["dtype"]
    name = {"cnn": "image", "mlp": "features", "attention": "tokens"}[arch]
    prefix = path.with_suffix("")
    paddle.onnx.export(model, str(prefix), input_spec=[paddle.static.InputSpec(shape, dtype, name)],
                       opset_version=17)


# --------------------------------------------------------------------------- spox


def spox_model(arch: str, w: dict[str, int], seed: int, masked: bool) -> Any:
    """Graphs built op by op, weights as Constant nodes (spox's `const`), as Silero's are."""
    import spox.opset.ai.onnx.v17 as op
    from spox import Tensor, argument, build

    rng = np.random.default_rng(seed)
    m = MASKS[arch] if masked else {k: [] for k in MASKS[arch]}

    def rand(*shape: int, fan_in: int = 0) -> np.ndarray:
        return trained_like(rng, shape, fan_in) if fan_in else (rng.standard_normal(shape) * 0.2).astype(np.float32)

    c = op.const
    if arch == "cnn":
        x = argument(Tensor(np.float32, ("batch", 3, 16, 16)))
        s, c1, pr, f1 = w["stem"], w["conv1"], w["project"], w["fc1"]
        stem = rand(s, 3, 3, 3, fan_in=27)
        gamma, beta = rng.uniform(0.5, 1.5, s).astype(np.float32), rand(s)
        mean, var = rand(s), rng.uniform(0.5, 1.5, s).astype(np.float32)
        gamma[m["stem"]] = 0
        beta[m["stem"]] = 0
        # BatchNorm as a converter writes it: a per-channel Mul and Add ([1, C, 1, 1] constants)
        scale = gamma / np.sqrt(var + 1e-5)
        shift = beta - mean * scale
        y = op.conv(x, c(stem), pads=[1, 1, 1, 1])
        y = op.relu(op.add(op.mul(y, c(scale.reshape(1, s, 1, 1))), c(shift.reshape(1, s, 1, 1).astype(np.float32))))
        w1, b1 = rand(c1, s, 3, 3, fan_in=9 * s), rand(c1)
        w1[m["conv1"]] = 0
        b1[m["conv1"]] = 0
        w2, b2 = rand(s, c1, 3, 3, fan_in=9 * c1), rand(s)
        w2[m["stem"]] = 0
        b2[m["stem"]] = 0
        r = op.conv(op.relu(op.conv(y, c(w1), c(b1), pads=[1, 1, 1, 1])), c(w2), c(b2), pads=[1, 1, 1, 1])
        y = op.add(y, r)
        y = op.conv(y, c(rand(s, 1, 3, 3, fan_in=9)), c(rand(s)), pads=[1, 1, 1, 1], group=s)
        wp, bp = rand(pr, s, 1, 1, fan_in=s), rand(pr)
        wp[m["project"]] = 0
        y = op.global_average_pool(op.relu(op.conv(y, c(wp), c(bp))))
        y = op.flatten(y)
        wf, bf = rand(pr, f1, fan_in=pr), rand(f1)
        wf[:, m["fc1"]] = 0
        bf[m["fc1"]] = 0
        y = op.relu(op.add(op.matmul(y, c(wf)), c(bf)))
        y = op.gemm(y, c(rand(5, f1, fan_in=f1)), c(rand(5)), transB=1)
    elif arch == "mlp":
        x = argument(Tensor(np.float32, ("batch", 32)))
        w1, b1 = rand(32, w["d1"], fan_in=32), rand(w["d1"])
        w1[:, m["d1"]] = 0
        b1[m["d1"]] = 0
        w2, b2 = rand(w["d1"], w["d2"], fan_in=w["d1"]), rand(w["d2"])
        w2[:, m["d2"]] = 0
        y = op.tanh(op.add(op.matmul(x, c(w1)), c(b1)))
        y = op.relu(op.add(op.matmul(y, c(w2)), c(b2)))
        y = op.add(op.matmul(y, c(rand(w["d2"], 10, fan_in=w["d2"]))), c(rand(10)))
    else:
        x = argument(Tensor(np.int64, ("batch", SEQ)))
        nh = w["heads"]
        hd = nh * HEAD_DIM
        e = op.gather(c(rng.standard_normal((VOCAB, D_MODEL)).astype(np.float32)), x)
        cols = [h * HEAD_DIM + j for h in m["heads"] for j in range(HEAD_DIM)]

        def heads(t: Any) -> Any:  # [B, T, H*d] -> [B, H, T, d]
            return op.transpose(op.reshape(t, c(np.array([0, 0, nh, HEAD_DIM], np.int64))), perm=[0, 2, 1, 3])

        q = heads(op.add(op.matmul(e, c(rand(D_MODEL, hd, fan_in=D_MODEL))), c(rand(hd))))
        k = heads(op.add(op.matmul(e, c(rand(D_MODEL, hd, fan_in=D_MODEL))), c(rand(hd))))
        wv, bv = rand(D_MODEL, hd, fan_in=D_MODEL), rand(hd)
        wv[:, cols] = 0
        bv[cols] = 0
        v = heads(op.add(op.matmul(e, c(wv)), c(bv)))
        scores = op.div(op.matmul(q, op.transpose(k, perm=[0, 1, 3, 2])), c(np.float32(np.sqrt(HEAD_DIM))))
        a = op.matmul(op.softmax(scores, axis=-1), v)
        a = op.reshape(op.transpose(a, perm=[0, 2, 1, 3]), c(np.array([0, 0, hd], np.int64)))
        wo = rand(hd, D_MODEL, fan_in=hd)
        wo[cols] = 0
        a = op.add(op.matmul(a, c(wo)), c(rand(D_MODEL)))
        h = op.layer_normalization(op.add(e, a), c((1 + rand(D_MODEL)).astype(np.float32)), c(rand(D_MODEL)), axis=-1)[0]
        f1w, f1b = rand(D_MODEL, w["ffn"], fan_in=D_MODEL), rand(w["ffn"])
        f1w[:, m["ffn"]] = 0
        f1b[m["ffn"]] = 0
        f = op.relu(op.add(op.matmul(h, c(f1w)), c(f1b)))
        f = op.add(op.matmul(f, c(rand(w["ffn"], D_MODEL, fan_in=w["ffn"]))), c(rand(D_MODEL)))
        y = op.reduce_mean(op.add(h, f), axes=[1], keepdims=0)
        y = op.add(op.matmul(y, c(rand(D_MODEL, 3, fan_in=D_MODEL))), c(rand(3)))
    name = {"cnn": "image", "mlp": "features", "attention": "tokens"}[arch]
    return build({name: x}, {"logits": y})


# --------------------------------------------------------------------------- driver

EXPORTERS = ("tf2onnx", "keras", "paddle2onnx", "spox")


def write(exporter: str, arch: str, out_dir: Path, seed: int) -> dict[str, Any]:
    import onnx

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{arch}.onnx"
    native = out_dir / f"{arch}.native.tmp.onnx"
    small = kept(arch)
    if exporter in ("tf2onnx", "keras"):
        keras_export(arch, FULL[arch], path, exporter, seed)
        keras_export(arch, small, native, exporter, seed)
    elif exporter == "paddle2onnx":
        paddle_export(arch, FULL[arch], path, seed)
        paddle_export(arch, small, native, seed)
    else:
        onnx.save(spox_model(arch, FULL[arch], seed, masked=True), str(path))
        onnx.save(spox_model(arch, small, seed, masked=False), str(native))
    native_params = count_params(onnx.load(str(native)))
    native.unlink()
    inputs = dict(INPUTS[arch])
    if arch == "cnn" and exporter in ("paddle2onnx", "spox"):
        inputs["shape"] = [1, 3, 16, 16]
    if arch == "attention" and exporter in ("paddle2onnx", "spox"):
        inputs["dtype"] = "int64"
    model = onnx.load(str(path))
    meta = {
        "exporter": exporter,
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "input": {"name": model.graph.input[0].name, **inputs},
        "masked": MASKS[arch],
        "kept_widths": small,
        "params": count_params(model),
        "native_params": native_params,
    }
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {path} ({path.stat().st_size} bytes): params {meta['params']}, native with kept channels {native_params}")
    return meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", choices=EXPORTERS, default=list(EXPORTERS))
    p.add_argument("--arch", nargs="*", choices=list(FULL), default=list(FULL))
    p.add_argument("--out", type=Path, default=ROOT / "models")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for exporter in args.only:
        for arch in args.arch:
            write(exporter, arch, args.out / exporter, args.seed)


if __name__ == "__main__":
    main()
