"""``minicb serve``: continuous batching behind an OpenAI-compatible HTTP server, with a live page.

The picture (one module per box)::

    clients (openai, curl, a browser)
        │ HTTP: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /, /live/events
        ▼
    app.py          FastAPI routes on uvicorn's event loop; reads bodies (bounded), streams SSE;
                    extra_routes.py: /tokenize, /detokenize, /version, /ping, /v1/models/{id}
        │ raw body ──► frontend.py: worker processes parse (protocol.py), render, tokenize
        │ RequestHandle ──► inbox            ◄── Deltas (token ids) via loop.call_soon_threadsafe
        │                                        detokenizer.py: text and stop strings (stops.py), on the loop
        ▼
    engine_thread.py   the only thread that touches the LLMEngine: add / abort / step / sleep when idle
        ▼ step events (engine.listen)
    metrics.py      Prometheus, vLLM's metric names          live.py   frames for the live page
                                                             static/live.html   the page itself
    server.py       wires them together and runs uvicorn (graceful SIGTERM / Ctrl-C)
    cli.py          ``minicb serve`` (argparse; imports the rest only when the command runs)

Importing this package imports nothing heavy; FastAPI, uvicorn and prometheus-client are the ``serve``
extra of the project (``pip install 'minicb[serve]'``; ``make setup`` installs them).
"""
