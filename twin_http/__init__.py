"""The twin as an OpenAI-compatible HTTP server in (scaled) real time (``servetune twin serve``).

One process serves every replica of a ServingConfig behind one port (the config's router policy
spreads requests over them, as :mod:`domain.twin.cluster` does offline); the token timing is
the twin engine's, run against the wall clock by :class:`domain.twin.realtime.RealtimeTwin`:
virtual time = (wall - start) x ``speedup``, so with ``speedup`` 10 every TTFT and inter-token
gap is a tenth of the engine's.

Endpoints (what SGLang 0.5.23's HTTP server answers, ``entrypoints/http_server.py``):

- ``POST /v1/completions`` and ``POST /v1/chat/completions``: ``stream: true`` sends one SSE
  event ``data: {chunk}`` per token (``finish_reason: "length"`` on the last), then a usage chunk
  (``choices: []``) when ``stream_options.include_usage`` is set, then ``data: [DONE]``;
  ``stream: false`` answers one JSON body, always with ``usage``. Usage carries
  ``prompt_tokens_details.cached_tokens`` (SGLang's ``--enable-cache-report``).
- ``GET /v1/models`` (the checkpoint's model path, as SGLang names the served model),
  ``GET /health`` (200 once serving), ``GET /metrics`` (Prometheus text, SGLang's names; see
  :func:`metrics_text`).

Token counts: a prompt is whitespace-separated words, one token each (the project's convention,
shared with ``mcp_servers/bench/prompts.py`` and the test stub; at least 1, like a BOS token);
chat prompts are the words of every message's text. Output is exactly ``max_tokens`` tokens
(``ignore_eos`` semantics; defaults: 16 for completions, SGLang's ``CompletionRequest``, and 128
for chat, SGLang's ``SamplingParams.max_new_tokens``), each one common English word, so a
whitespace count of the text equals ``completion_tokens``. Requests SGLang refuses up front
(prompt over the context length, prompt + max_tokens over it, prompt over the KV pool's input
limit) get HTTP 400 with SGLang's ``ErrorResponse`` body and message; a request the engine drops
later (it never fits the KV pool) ends its stream with an error event, or a 400 body. A client
that disconnects aborts its request in the engine (its slot and KV are freed).

Every response carries the header ``x-servetune-simulated: twin``
(:data:`domain.quality.SIMULATED_HEADER`), which SGLang never sends: a client can tell the twin
from a real server, and the quality gate is not applicable to its outputs.

Startup: the twin's startup (:func:`domain.twin.startup.start`) prints the engine's log; a config
the engine refuses exits with the engine's code and error line (like a failed ``sglang serve``),
a servable one binds, prints ``The server is fired up and ready to roll!`` and (``--port-file``)
writes the bound port. Startup is immediate (the engine's load time is not waited out).

Modules: :mod:`twin_http.protocol` (request parsing, SGLang's error body, token counting),
:mod:`twin_http.service` (the real-time twin behind the Starlette app, /metrics) and
:mod:`twin_http.server` (bind and serve with uvicorn). Only starlette, uvicorn and the domain
are imported: the package sits beside the twin, in the layer of ``memory`` and ``sandbox``.
"""
