"""The draft-model drafter: a smaller model with the target's tokenizer, loaded in the same
worker, proposes k tokens per request and step by greedy decoding, batched across requests.

It keeps its own paged KV cache (`num_blocks` blocks of the engine's block size, allocated
from the worker's KV budget: see `draft_kv_bytes_per_block`) and its own per-request block
lists. Each step a request's new tokens (its prompt the first time, then the tokens the
target kept) are run as one chunk per request, in one forward for all requests; the argmax of
each last row is draft 1; then k - 1 batched one-token forwards give drafts 2..k. Draft
positions are never counted as cached: the next step recomputes the kept ones with the
target's token, so a refused draft's KV is simply overwritten.

Greedy drafts are a point mass, so the engine's rejection sampler (pagedserve.engine.spec_decode.rejection)
keeps sampled output exact; greedy output equals plain decoding's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.engine.attention.metadata import AttentionMetadata
from pagedserve.engine.attention.selector import select_backend
from pagedserve.engine.model.kv_pool_size import kv_cache_bytes_per_block
from pagedserve.engine.model.loader import allocate_kv_caches, load_model, read_config


@dataclass(slots=True)
class _DraftState:
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens of the request whose KV is in the draft cache


def draft_kv_bytes_per_block(model_dir: str, block_size: int, dtype: torch.dtype) -> int:
    return kv_cache_bytes_per_block(read_config(model_dir), block_size, dtype)


class DraftModelProposer:
    def __init__(
        self,
        model_dir: str,
        num_tokens: int,
        dtype: torch.dtype,
        device: str,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        config = read_config(model_dir)
        if int(config["vocab_size"]) != vocab_size:
            raise ValueError(
                f"speculative.draft_model: its vocabulary has {config['vocab_size']} tokens, the "
                f"served model's {vocab_size}: the two must share a tokenizer"
            )
        self.device = torch.device(device)
        backend = select_backend(self.device)
        self.model = load_model(model_dir, dtype, device, backend, max_model_len=max_model_len)
        self.kv_caches = allocate_kv_caches(config, num_blocks, block_size, dtype, device)
        self.num_tokens = num_tokens
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() takes the lowest id first
        self._states: dict[str, _DraftState] = {}

    # -- blocks ----------------------------------------------------------------------------
    def _reserve(self, state: _DraftState, num_positions: int) -> bool:
        need = -(-num_positions // self.block_size) - len(state.blocks)
        if need > len(self._free):
            return False
        state.blocks.extend(self._free.pop() for _ in range(max(0, need)))
        return True

    def release(self, req_ids) -> None:
        for req_id in req_ids:
            state = self._states.pop(req_id, None)
            if state is not None:
                self._free.extend(reversed(state.blocks))

    def live_requests(self):
        return self._states.keys()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    # -- drafting --------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        """`requests`: (id, all its tokens, most drafts wanted). Returns each one's drafts (none
        for a request whose blocks do not fit the draft pool this step)."""
        batch: list[tuple[str, _DraftState, list[int], int]] = []
        for req_id, tokens, k in requests:
            k = min(k, self.num_tokens)
            state = self._states.setdefault(req_id, _DraftState())
            if k < 1:
                continue
            state.num_cached = min(state.num_cached, len(tokens) - 1)  # at least one token to run
            if self._reserve(state, len(tokens) + k - 1):
                batch.append((req_id, state, tokens, k))
        if not batch:
            return {}
        drafts: dict[str, list[int]] = {req_id: [] for req_id, _, _, _ in batch}
        # Step 1: every request's new tokens as one chunk each; the last row's argmax is draft 1.
        chunks = [(state, tokens[state.num_cached :], state.num_cached) for _, state, tokens, _ in batch]
        last = self._forward(chunks)
        for (req_id, state, tokens, _), token in zip(batch, last):
            state.num_cached = len(tokens)
            drafts[req_id].append(token)
        # Steps 2..k: one token per request still drafting.
        for i in range(1, max(k for *_, k in batch)):
            active = [(req_id, state, tokens) for req_id, state, tokens, k in batch if k > i]
            chunks = [(state, [drafts[req_id][-1]], len(tokens) + i - 1) for req_id, state, tokens in active]
            for (req_id, _, _), token in zip(active, self._forward(chunks)):
                drafts[req_id].append(token)
        return drafts

    def _forward(self, chunks: list[tuple[_DraftState, list[int], int]]) -> list[int]:
        """Run each chunk (tokens starting at a position) with its request's blocks; returns the
        argmax after each chunk's last token. Single-token chunks are ordered first, as the
        attention backends want."""
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i][1]) != 1)
        ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        width = max(len(chunks[i][0].blocks) for i in order)
        tables = torch.zeros(len(order), width, dtype=torch.int32)
        for row, i in enumerate(order):
            state, tokens, start = chunks[i]
            ids.extend(tokens)
            for pos in range(start, start + len(tokens)):
                positions.append(pos)
                slots.append(state.blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            tables[row, : len(state.blocks)] = torch.tensor(state.blocks, dtype=torch.int32)
        dev = self.device
        cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        meta = AttentionMetadata(
            num_seqs=len(order),
            num_tokens=len(ids),
            query_lens=query_lens,
            seq_lens=seq_lens,
            query_start_loc=cu.to(dev),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            num_decodes=sum(1 for q in query_lens if q == 1),
        )
        hidden = self.model(
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            self.kv_caches,
            meta,
        )
        logits = self.model.compute_logits(hidden[(cu[1:] - 1).long().to(dev)])
        assert logits is not None  # a draft model runs on one rank, which gets every logit
        tokens = logits.argmax(dim=-1).tolist()
        out = [0] * len(chunks)
        for row, i in enumerate(order):
            out[i] = tokens[row]
        return out
