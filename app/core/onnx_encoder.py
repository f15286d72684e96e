"""The question encoder through ONNX Runtime: the sentence-transformers model (transformer, pooling, normalising)
exported once at load into one fused graph, run on the CPU. A question's encoding is a few hundred million
multiply-adds through dozens of small operators; ONNX Runtime fuses attention, GELU and layer norms and runs the
rest with its own matrix kernels. On some CPUs that halves torch's eager time for the same vectors, on others
torch's kernels are faster (``bench.query_encoder``), so 'auto' times both at load. In int8 the graph is quantized
by ONNX Runtime's own dynamic quantizer (weights per output channel; activations at run time, per question), which
halves the time again on the CPUs measured. The export is held in memory (the quantizer's file goes to a temporary
folder, removed at once), so the graph always matches the weights just loaded. It uses torch's TorchScript-based
exporter (``dynamo=False``; deprecated since torch 2.9 for the torch.export one, which needs onnxscript): should a
later torch drop it, 'auto' falls back to torch, said in the log."""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np


class OnnxEncoder:
    """``embed`` as ``Embedder`` does for questions, through an ONNX Runtime session of ``threads`` threads."""

    def __init__(self, model: Any, threads: int, int8: bool = False) -> None:
        """``model``: a loaded float32 ``SentenceTransformer`` on the CPU (its tokenizer keeps preparing inputs)."""
        import onnxruntime

        self.model = model
        # Traced on a padded batch of two: a batch of equal lengths would let the tracer drop the attention mask.
        example = model.preprocess(["a question", "a longer question, so the first one is padded"])
        self.inputs = [name for name, value in example.items() if hasattr(value, "numpy")]
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # idle threads sleep, not spin
        graph = _export(model, example, self.inputs)
        self.session = onnxruntime.InferenceSession(_int8(graph) if int8 else graph, options,
                                                    providers=["CPUExecutionProvider"])

    def embed(self, texts: list[str]) -> list[list[float]]:
        features = self.model.preprocess(texts)
        vectors = self.session.run(None, {name: features[name].numpy() for name in self.inputs})[0]
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return list(vectors.tolist())


def _export(model: Any, example: dict[str, Any], inputs: list[str]) -> bytes:
    """The model's whole forward pass as ONNX, traced on ``example`` (its ``inputs``), with the batch and the
    sequence length left free."""
    import torch

    class Whole(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
            embedding: torch.Tensor = self.model(dict(zip(inputs, tensors, strict=True)))["sentence_embedding"]
            return embedding

    free = {0: "batch", 1: "tokens"}
    graph = io.BytesIO()
    whole = Whole().eval()  # the exporter puts the module back in the mode it found: eval, as loaded
    with warnings.catch_warnings():  # the tracer's notes on Python branches it fixed: expected, and noise in logs
        warnings.simplefilter("ignore")
        torch.onnx.export(whole, tuple(example[name] for name in inputs), graph,  # type: ignore[arg-type]  # the
                          # TorchScript exporter writes to any binary file object; its stubs name only paths
                          input_names=inputs,
                          output_names=["embedding"], dynamic_axes={name: free for name in inputs}, dynamo=False)
    return graph.getvalue()


def _int8(graph: bytes) -> bytes:
    """``graph`` with its matrix multiplications in int8: weights quantized per output channel (per tensor, the
    vectors drift further from float32's), activations quantized as each batch runs."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(prefix="prefixrag-int8-") as folder, _quantizer_quiet():
        target = Path(folder) / "encoder-int8.onnx"
        quantize_dynamic(onnx.load_from_string(graph), target, per_channel=True, weight_type=QuantType.QInt8)
        return target.read_bytes()


@contextlib.contextmanager
def _quantizer_quiet() -> Iterator[None]:
    """The quantizer logs on the root logger: advice to run a shape-inference pass first (which fails on this
    graph: symbolic shapes it cannot infer) and a line per tensor it leaves in float32, noise in every ranking
    worker's log at load. Its own records are dropped while it runs."""
    def not_the_quantizers(record: logging.LogRecord) -> bool:
        return "onnxruntime" not in record.pathname

    root = logging.getLogger()
    root.addFilter(not_the_quantizers)
    try:
        yield
    finally:
        root.removeFilter(not_the_quantizers)
