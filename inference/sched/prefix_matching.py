"""The prefix-cache side of the per-step context: the key a request's chain is hashed and matched
under, the hashes of its matchable blocks, how much of a cached prefix it may take (prompt scores,
state snapshots), and the hash chains broken by a reset (a mixin of `DynamicInferenceContext`, over
its per-slot arrays)."""

from __future__ import annotations

from typing import Any

import numpy as np

from inference.kv_cache.block_key import BlockKey
from inference.kv_cache.hashing import NO_PARENT, encode_extra_key, packed_block_hashes
from inference.request import Request
from inference.sched.prompt_logprobs import servable_prefix

MAX_MEMOISED_KEYS = 1024  # chain keys kept by `chain_key` (one per version, salt and adapter in use)


class PrefixMatching:
    """`DynamicInferenceContext`'s prefix matching (module docstring); the state it reads and writes
    is the context's."""

    allocator: Any
    state_prefix: Any
    block_size: int
    _chain_keys: dict

    def break_hash_chains(self, slots: list[int] | None = None) -> None:
        """After a prefix-cache reset (of all, or of the `slots`' key versions): blocks in flight
        may not register under the new version."""
        slots = slice(None) if slots is None else slots
        self.cache_broken[slots] = True
        self.offers_scores[slots] = False
        self.state_cacheable[slots] = False

    def block_key(self, req: Request) -> BlockKey:
        """The key `req`'s chain is hashed and matched under: its salt version (SALTED) or the
        current one (RESET), its cache salt, and its LoRA adapter's name and version (blocks
        computed under another adapter, or another version of it, never match)."""
        return self.chain_key(req)[0]

    def chain_key(self, req: Request, policy_version: int | None = None) -> tuple[BlockKey, bytes]:
        """`block_key(req)` and the bytes it mixes into each hash (`encode_extra_key`), memoised:
        registration asks for them per request each step (passing the current `policy_version`,
        read once for all)."""
        lora = req.lora
        if not req.salted:
            policy_version = self.policy_version if policy_version is None else policy_version
        return self.chain_key_of((req.start_version if req.salted else policy_version, req.params.cache_salt,
                                  None if lora is None else lora.name, None if lora is None else lora.version))

    def plain_chain_key(self, policy_version: int) -> tuple[BlockKey, bytes]:
        """`chain_key` of any request of a `plain_key` slot under `policy_version`."""
        return self.chain_key_of((policy_version, None, None, None))

    def chain_key_of(self, fields: tuple) -> tuple[BlockKey, bytes]:
        """The key of `fields` (version, cache salt, adapter name, adapter version) and its bytes,
        memoised: the one place every chain key is made (lookup and registration alike)."""
        found = self._chain_keys.get(fields)
        if found is None:
            if len(self._chain_keys) >= MAX_MEMOISED_KEYS:  # NOTE: salts may be per request
                self._chain_keys.clear()
            key = BlockKey(*fields)
            found = self._chain_keys[fields] = (key, encode_extra_key(key.hash_key()))
        return found

    def rule_version(self, req: Request) -> int | None:
        """The version a block `req` reads must have been computed by: the current one, unless the
        request carries an explicit version salt (SALTED: any block of its key, see the match rule)."""
        return None if req.salted else self.policy_version

    def uses_prefix_cache(self, req: Request) -> bool:
        # NOTE: a request recording its routing computes every position (a hit would skip routes)
        return self.allocator.enable_prefix_caching and not req.params.return_routed_experts

    def prefix_to_match(self, req: Request) -> list[int]:
        """Hashes of the leading blocks `req` may take from the cache: its matchable ones, cut
        before the first cached block that lacks prompt scores it asks for (see PromptScores) and,
        for a model with state, back to the farthest state snapshot (see StatePrefixCache)."""
        return self._prefix_to_match(req)[0]

    def _prefix_to_match(self, req: Request) -> tuple[list[int], int]:
        """(`prefix_to_match`, cached blocks past it given up for want of a state snapshot)."""
        hashes = self.matchable_hashes(req)
        top_n = req.params.prompt_logprobs
        if top_n is not None and hashes:
            hashes = servable_prefix(self.allocator, hashes, req.prompt_token_ids, top_n)
        if self.state_prefix is None or not hashes:
            return hashes, 0
        return self.state_prefix.usable(hashes)

    def cut_chunk(self, slot: int, chunk: int) -> int:
        """The slot's next prefill chunk of up to `chunk` tokens, cut where its state can be
        snapshotted (models with state; see StatePrefixCache.chunk)."""
        if self.state_prefix is None:
            return chunk
        return self.state_prefix.chunk(int(self.kv_len[slot]), chunk, int(self.seq_len[slot]),
                                       int(self.state_branch[slot]))

    def snapshot_states(self, slots: np.ndarray) -> None:
        """After a forward (and `register_full_blocks`): keep the state of the prefill `slots` whose
        chunk ended on a cached block boundary."""
        if self.state_prefix is not None and slots.size:
            self.state_prefix.snapshot(slots.tolist(), self.kv_len, self.state_cacheable, self.state_slot,
                                       lambda s: self.hashes[s], lambda s: self.matchable_hashes(self.requests[s]))

    def matchable_hashes(self, req: Request) -> list[int]:
        """Hashes of the full blocks before the last token (at least one token is computed)."""
        block_key, salt = self.chain_key(req)
        key = (block_key.version, req.num_tokens)
        if req.hash_cache_key != key:  # NOTE: scheduling asks again each step while it waits
            tokens = req.all_token_ids
            usable = (len(tokens) - 1) // self.block_size * self.block_size
            packed = np.asarray(tokens[:usable], dtype=np.int64).tobytes()
            req.hash_cache = packed_block_hashes(packed, self.block_size, NO_PARENT, salt)
            req.hash_cache_key = key
        return req.hash_cache
