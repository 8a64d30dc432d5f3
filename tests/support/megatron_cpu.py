"""The CPU shims megatron-core needs to build and run a GPTModel without CUDA, all in one place.

Use them as one block around everything megatron does (build, forward, backward, optimizer):

    with megatron_cpu(seed=0):
        model = build_gpt_model(spec)
        logits = gpt_logits(model, input_ids)

At TP = PP = 1 megatron-core assumes a GPU in three places that a GPTModel reaches:

1. `torch.cuda.current_device()` places tensors at build time and on *every forward*
   (`RotaryEmbedding.get_emb` moves its `inv_freq` to "the current CUDA device"); on a CPU build
   of torch it raises. Inside the block it returns `torch.device("cpu")`; the original is put
   back on exit.
2. The RNG tracker (`tensor_parallel.random`): every attention forward enters
   `get_cuda_rng_tracker().fork()` around dropout, and seeding it reads
   `torch.cuda.get_rng_state()`. Inside the block the tracker is a `CpuRNGStatesTracker`, the
   same contract over CPU generator states, seeded by megatron's own
   `model_parallel_cuda_manual_seed` so the named streams are megatron's.
3. `parallel_state` needs a process group: a single-process gloo group over an in-memory
   `HashStore` (no port, no network), then `initialize_model_parallel(1, 1)`. An existing
   process group is used as is and left alone.

Not a shim: `transformer.utils.get_default_causal_mask` hard-codes `device="cuda"`, so
`gpt_logits` passes an explicit causal mask and megatron never builds its own.

NOTE: the state is process-global because megatron's is (parallel_state, the RNG tracker). The
block is re-entrant; the outermost exit undoes exactly what its entry did.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from inference.models.spec import ModelSpec, RopeKind, RopeSpec

# NOTE: megatron is noisy on CPU, never about anything a caller here can act on: its import
# warns that Transformer Engine / Apex are absent (the local spec needs neither) and raises
# DeprecationWarnings about its own modules; building and running a model warns about arguments
# its own layer spec and forward leave out. Only these are silenced, and only around those calls.
_ABSENT_EXTENSIONS = r".*(Transformer Engine and Apex|Apex) (are|is) not installed.*"
_MEGATRON_NOISE = (_ABSENT_EXTENSIONS, ".*tp_group is None.*", ".*MLP requires ffn_hidden_size.*")

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=_ABSENT_EXTENSIONS)
    warnings.simplefilter("ignore", DeprecationWarning)
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.transformer_config import TransformerConfig

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")


class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
    """Megatron's named RNG streams over CPU generator states.

    `add(name, seed)` creates a stream; `fork(name)` swaps it into torch's default (CPU)
    generator for the block and swaps it back out after, so dropout inside a model-parallel
    region draws from its own stream exactly as the CUDA tracker arranges on a GPU.
    """

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


class _Shims:
    """What the outermost `megatron_cpu()` entry changed, so its exit undoes exactly that."""

    __slots__ = ("depth", "current_device", "made_group", "made_parallel", "tracker")

    def __init__(self) -> None:
        self.depth = 0
        self.current_device = None
        self.made_group = self.made_parallel = False
        self.tracker = None


_SHIMS = _Shims()


def megatron_cpu_active() -> bool:
    return _SHIMS.depth > 0


@contextlib.contextmanager
def megatron_cpu(seed: int = 1234) -> Iterator[None]:
    """Run megatron-core on CPU inside this block (see the module docstring for each shim)."""
    s = _SHIMS
    if s.depth == 0:
        if torch.cuda.is_available():
            logger.warning("megatron_cpu: CUDA is available; megatron will still be run on CPU here")
        s.current_device = torch.cuda.current_device
        torch.cuda.current_device = lambda: _CPU
        try:
            if not dist.is_initialized():
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
                s.made_group = True
            if not parallel_state.model_parallel_is_initialized():
                parallel_state.initialize_model_parallel(1, 1)
                s.made_parallel = True
            s.tracker = (megatron_random._CUDA_RNG_STATE_TRACKER, megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED)
            megatron_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
            megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
            # NOTE: its `torch.cuda.manual_seed` is queued lazily without CUDA, so harmless
            megatron_random.model_parallel_cuda_manual_seed(seed)
        except BaseException:
            _undo(s)
            raise
    s.depth += 1
    try:
        yield
    finally:
        s.depth -= 1
        if s.depth == 0:
            _undo(s)


def _undo(s: _Shims) -> None:
    if s.tracker is not None:
        megatron_random._CUDA_RNG_STATE_TRACKER, megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = s.tracker
        s.tracker = None
    if s.made_parallel:
        parallel_state.destroy_model_parallel()
        s.made_parallel = False
    if s.made_group:
        dist.destroy_process_group()
        s.made_group = False
    if s.current_device is not None:
        torch.cuda.current_device = s.current_device
        s.current_device = None


def _as_spec(config: ModelSpec | Mapping[str, Any] | Any) -> ModelSpec:
    if isinstance(config, ModelSpec):
        return config
    cfg = dict(config) if isinstance(config, Mapping) else config.to_dict()
    cfg.setdefault("model_type", "llama")
    return ModelSpec.from_hf_config(cfg)


def _rope_args(rope: RopeSpec) -> dict[str, Any]:
    args: dict[str, Any] = {"rotary_base": rope.theta}
    if rope.kind is RopeKind.LINEAR:
        args["seq_len_interpolation_factor"] = rope.factor
    elif rope.kind is RopeKind.LLAMA3:
        if (rope.low_freq_factor, rope.high_freq_factor, rope.original_max_position_embeddings) != (1.0, 4.0, 8192):
            raise NotImplementedError("megatron's llama3 rope scaling fixes low/high factors 1/4 and length 8192")
        args.update(rope_scaling=True, rope_scaling_factor=rope.factor)
    return args


def build_gpt_model(config: ModelSpec | Mapping[str, Any] | Any, *, seed: int | None = None) -> GPTModel:
    """A Llama-style megatron-core GPTModel (local, non-TE layer spec) for `config` on CPU.

    `config` is a `ModelSpec`, an HF config dict (`model_type` defaults to llama) or an HF
    `PretrainedConfig`. RMSNorm, SwiGLU, rotate-half RoPE, GQA; biases as Llama (none or all)
    or Qwen2 (q/k/v only); Qwen3's q/k norms; tied or untied embeddings. Call inside
    `megatron_cpu()`.
    """
    if not megatron_cpu_active():
        raise RuntimeError("build_gpt_model: call inside `with megatron_cpu():`")
    spec = _as_spec(config)
    if spec.sliding_window is not None:
        raise NotImplementedError("build_gpt_model: sliding-window attention")
    if (spec.o_bias, spec.mlp_bias) not in ((False, False), (True, True)) or (spec.o_bias and not spec.qkv_bias):
        raise NotImplementedError("build_gpt_model: megatron has biases on all linears or on q/k/v only")
    if seed is not None:
        torch.manual_seed(seed)
    transformer = TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=spec.o_bias,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # NOTE: the fusions are CUDA kernels (or TE); their unfused forms are the same maths
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=True,
        cuda_graph_scope=[],  # NOTE: megatron's own default ("full") warns that it is deprecated
        params_dtype=spec.dtype,
    )
    with warnings.catch_warnings():
        for message in _MEGATRON_NOISE:
            warnings.filterwarnings("ignore", message=message)
        return GPTModel(
            transformer,
            get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=spec.qk_norm),
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.max_position_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            **_rope_args(spec.rope),
        )


def gpt_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Megatron's own forward: logits `[B, S, vocab]` for `input_ids` `[B, S]` (grad as the caller's).

    The causal mask is passed explicitly (True = masked) because megatron's default one is built
    on "cuda".
    """
    seq = input_ids.shape[1]
    positions = torch.arange(seq, device=input_ids.device).expand_as(input_ids)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=input_ids.device).triu(1)[None, None]
    with warnings.catch_warnings():
        for message in _MEGATRON_NOISE:
            warnings.filterwarnings("ignore", message=message)
        return model(input_ids, positions, mask)
