"""Model definitions that read and write the paged KV cache."""

from inference.models.decoder import BindReport, DenseDecoder
from inference.models.loading import load_from_hf_dir, load_from_hf_model
from inference.models.spec import ModelFamily, ModelSpec, RopeKind, RopeSpec

__all__ = [
    "BindReport",
    "DenseDecoder",
    "ModelFamily",
    "ModelSpec",
    "RopeKind",
    "RopeSpec",
    "load_from_hf_dir",
    "load_from_hf_model",
]
