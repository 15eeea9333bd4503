"""The llama.cpp engine: a concurrent, continuously batching OpenAI-compatible server.

Layers (seed 003): the HTTP edge (`http_app`) submits to a pure `BatchScheduler`
(request queue, running set, sequence-id pool, KV cache manager, timeouts);
one decode thread (`engine`) owns the llama.cpp context (`llama_backend`) and
turns each scheduler plan into a single `llama_decode` call.
"""

ENGINE_NAME = "llama.cpp"
