"""What a 404 or 405 says: the OpenAI and vLLM APIs kimik3 does not serve, each with the reason, and the routes
it does serve, so ``client.embeddings.create(...)`` or ``client.chat.completions.list()`` fails with a message
that says why instead of a bare "Not Found"."""

from __future__ import annotations

SERVED = ("POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, GET /v1/models, POST /tokenize, "
          "POST /detokenize, GET /version, GET /health, /ping, GET /metrics, POST /rebalance_experts (EPLB)")
_GENERATIVE = "kimik3 serves Kimi-K3 / Kimi-Linear as generative models only (no pooling, embedding or scoring)"
_NOT_STORED = "nothing is stored here (store=true is refused)"

# (path prefix, reason); the first match wins
_REASONS: tuple[tuple[str, str], ...] = (
    ("/v1/chat/completions/", f"stored chat completions: {_NOT_STORED}, so none can be retrieved, updated, deleted "
                              f"or listed"),
    ("/v1/responses/input_tokens", "counting input tokens: POST /tokenize with the messages gives the count"),
    ("/v1/responses/", f"stored responses: {_NOT_STORED}, so none can be retrieved, deleted, cancelled, compacted "
                       f"or listed"),
    ("/v1/embeddings", _GENERATIVE), ("/v1/pooling", _GENERATIVE), ("/pooling", _GENERATIVE),
    ("/v1/score", _GENERATIVE), ("/score", _GENERATIVE), ("/v1/rerank", _GENERATIVE), ("/v2/rerank", _GENERATIVE),
    ("/rerank", _GENERATIVE), ("/v1/classify", _GENERATIVE), ("/classify", _GENERATIVE),
    ("/v1/audio/", "K3 has no audio input or output"),
    ("/v1/images/", "K3 writes text; it does not generate or edit images (image input is a chat image_url part)"),
    ("/v1/videos", "K3 writes text; it does not generate videos (video input is a chat video_url part)"),
    ("/v1/moderations", "no moderation model is served"),
    ("/v1/files", "there is no file store: send images and videos inline as data: URLs (or file:// URLs under "
                  "--allowed-local-media-path)"),
    ("/v1/uploads", "there is no file store: send media inline as data: URLs"),
    ("/v1/batches", "there is no batch API: send the requests concurrently; the engine batches them"),
    ("/v1/fine_tuning", "kimik3 runs inference only"),
    ("/v1/vector_stores", "there is no retrieval store"),
    ("/v1/assistants", "the Assistants API (stateful assistants and threads) is not served; use chat or responses"),
    ("/v1/threads", "the Assistants API (stateful assistants and threads) is not served; use chat or responses"),
    ("/v1/conversations", f"stored conversations: {_NOT_STORED}; send the whole conversation each time"),
    ("/v1/realtime", "there is no realtime (WebSocket) API; stream /v1/chat/completions or /v1/responses instead"),
    ("/v1/chatkit", "ChatKit is not served"), ("/v1/containers", "code containers are not served"),
    ("/v1/evals", "evals are not served"), ("/v1/skills", "skills are not served"),
)


def unserved_message(status: int, method: str, path: str) -> str | None:
    """The message for a 404 / 405 on ``method path``, or None to keep the default."""
    if status == 405 and path.rstrip("/") == "/v1/chat/completions":
        return (f"{method} /v1/chat/completions: listing stored chat completions is not served, {_NOT_STORED}; "
                f"POST to create a completion")
    if status == 405 and path.rstrip("/") == "/v1/responses":
        return f"{method} /v1/responses: listing stored responses is not served, {_NOT_STORED}; POST to create one"
    if status != 404:
        return None
    for prefix, reason in _REASONS:
        if path == prefix.rstrip("/") or path.startswith(prefix):
            return f"{method} {path} is not served: {reason}. kimik3 serves {SERVED}"
    return f"{method} {path}: no such route. kimik3 serves {SERVED}"
