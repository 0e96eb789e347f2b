"""Either kind of model a user brings: a model file (`piper.model_file`) or a Hugging Face
`config.json` / model folder (`piper.hf`). Kept apart from both so that they depend one way
(`piper.hf` builds on `piper.model_file`'s contract)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from piper.errors import PiperError
from piper.model_file import ModelSpec, load_model_file


def load_model(path: str | Path, model_args: tuple[tuple[str, Any], ...] = (),
               options: tuple[tuple[str, Any], ...] = ()) -> ModelSpec:
    """A model file, or a Hugging Face `config.json` / model folder (`piper.hf`); a name
    a cluster run shipped it under is found on this node (`piper.shipped`)."""
    from piper.hf import is_hf_model
    from piper.shipped import local_path

    path = local_path(str(path))
    if is_hf_model(path):
        from piper.hf import load_hf_model

        return load_hf_model(path, model_args, **dict(options))
    if options:
        raise PiperError(f"{path}: --{options[0][0].replace('_', '-')} is for Hugging Face "
                         "models (a config.json or model folder); a model file makes its "
                         "own batch in example_batch")
    return load_model_file(path, model_args)
