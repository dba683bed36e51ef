"""Speculative decoding: proposing draft tokens and verifying them against the target model."""
