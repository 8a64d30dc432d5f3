"""Earlier samples of each prompt, kept to draft from: RL samples the same prompts every epoch."""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np


class PromptHistory:
    """The generated tokens of the last `samples` finished samples of each of the `prompts` prompts
    seen most recently (least recently used prompt dropped first). Host memory only."""

    __slots__ = ("samples", "prompts", "_by_prompt")

    def __init__(self, samples: int, prompts: int) -> None:
        self.samples = samples
        self.prompts = prompts
        self._by_prompt: OrderedDict[tuple[int, ...], deque[np.ndarray]] = OrderedDict()

    def add(self, prompt: tuple[int, ...], generated: np.ndarray) -> None:
        if self.samples == 0 or generated.size == 0:
            return
        kept = self._by_prompt.get(prompt)
        if kept is None:
            kept = self._by_prompt[prompt] = deque(maxlen=self.samples)
            if len(self._by_prompt) > self.prompts:
                self._by_prompt.popitem(last=False)
        else:
            self._by_prompt.move_to_end(prompt)
        kept.append(np.array(generated, dtype=np.int64))

    def of(self, prompt: tuple[int, ...]) -> list[np.ndarray]:
        kept = self._by_prompt.get(prompt)
        return [] if kept is None else list(kept)

    def __len__(self) -> int:
        return len(self._by_prompt)
