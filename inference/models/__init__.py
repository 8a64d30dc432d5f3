"""Model definitions that read and write the paged KV cache."""

from inference.models.dense.decoder import BindReport, DenseDecoder
from inference.models.hybrid.decoder import HybridDecoder
from inference.models.hybrid.spec import HybridFamily, HybridSpec
from inference.models.loading import load_from_hf_dir, load_from_hf_model
from inference.models.spec import ModelFamily, ModelSpec, RopeKind, RopeSpec

__all__ = [
    "BindReport",
    "DenseDecoder",
    "HybridDecoder",
    "HybridFamily",
    "HybridSpec",
    "ModelFamily",
    "ModelSpec",
    "RopeKind",
    "RopeSpec",
    "load_from_hf_dir",
    "load_from_hf_model",
]
