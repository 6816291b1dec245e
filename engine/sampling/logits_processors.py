"""Logits processors run before sampling: min_tokens masking, logit bias and repetition penalties.

Each function returns a new tensor and leaves its input unchanged.
"""

from __future__ import annotations

import torch


def apply_min_tokens(logits: torch.Tensor, suppress: dict[int, list[int]] | None) -> torch.Tensor:
    """Set logits[row, token] = -inf for each row's suppressed tokens (EOS / stop ids)."""
    if not suppress:
        return logits
    rows = [row for row, ids in suppress.items() for _ in ids]
    cols = [tok for ids in suppress.values() for tok in ids]
    out = logits.clone()
    out[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
    return out


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, dict[int, float]] | None) -> torch.Tensor:
    """Add each row's bias to its tokens' logits: {row: {token id: bias}} (OpenAI's logit_bias;
    ids are inside the vocabulary, checked where the request entered)."""
    if not bias:
        return logits
    rows = [row for row, entries in bias.items() for _ in entries]
    cols = [tok for entries in bias.values() for tok in entries]
    values = [b for entries in bias.values() for b in entries.values()]
    out = logits.clone()
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    out.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)
    return out


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Apply repetition, frequency and presence penalties (vLLM semantics).

    Repetition (HF / CTRL): for every token seen in the prompt or the output, positive logits
    are divided by the penalty and negative ones multiplied. Frequency and presence (OpenAI):
    logit -= frequency * count_in_output + presence * (count_in_output > 0); the prompt does
    not count. Token id tensors are padded with vocab_size, which is ignored.
    """
    vocab_size = logits.shape[1]
    output_counts = token_counts(output_token_ids, vocab_size)
    output_mask = output_counts > 0
    seen = token_counts(prompt_token_ids, vocab_size) > 0
    seen |= output_mask
    scale = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / scale, logits * scale)
    logits = logits - frequency_penalties.unsqueeze(1) * output_counts
    return logits - presence_penalties.unsqueeze(1) * output_mask


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, L] ids padded with vocab_size -> [N, vocab_size] float32 occurrence counts."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]
