"""Sampling: the parameters (SamplingParams), their per-step metadata, logits processors, the sampler."""
