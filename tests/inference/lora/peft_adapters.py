"""Random PEFT LoRA adapters for tiny HF models, saved as PEFT saves them (`save_pretrained`)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from inference.lora import LORA_PROJECTIONS

ALL_LINEAR = list(LORA_PROJECTIONS)


def save_adapter(base: torch.nn.Module, path: Path, *, r: int, alpha: float, targets: list[str] | str, seed: int,
                 std: float = 0.1, **lora_kwargs) -> Path:
    """A LoRA of rank `r` on `targets` of a copy of `base`, every A and B random (PEFT zero-inits B,
    which would make the adapter the identity), saved under `path`."""
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, init_lora_weights=False,
                        **lora_kwargs)
    model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std)
    model.save_pretrained(str(path))
    return path


def peft_reference(base: torch.nn.Module, path: Path) -> PeftModel:
    """HF + PEFT with the adapter applied by PEFT's LoRA layers (not merged into the weights)."""
    return PeftModel.from_pretrained(copy.deepcopy(base), str(path)).eval()


@torch.no_grad()
def greedy_with_logprobs(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs, each step a full forward over the sequence so far."""
    ids = list(prompt)
    tokens, logprobs = [], []
    for _ in range(steps):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        tok = int(logits.argmax())
        tokens.append(tok)
        logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
        ids.append(tok)
    return tokens, logprobs


def live_peft(base: torch.nn.Module, *, std: float, seed: int = 1) -> PeftModel:
    """A trainer's live PEFT model of `base` (rank 4, alpha 8, every linear projection), its LoRA
    tensors drawn from N(0, std) so that the adapter changes the outputs."""
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR,
                                                           init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std)
    return model.eval()


def lora_step(model: torch.nn.Module, seed: int, scale: float) -> None:
    """A stand-in optimizer step: every LoRA tensor moves, in place (the base weights never do)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)
