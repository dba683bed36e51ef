"""Sampling: the per-request parameters, logit controls (penalties, bad words, structured outputs), the sampler and logprobs."""
