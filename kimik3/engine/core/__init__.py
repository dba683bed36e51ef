"""The engine's bookkeeping: requests, the hybrid KV cache and its block pool, the memory plan, the scheduler, input processing, outputs and the engine loop (``LLMEngine``)."""
