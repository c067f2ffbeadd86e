"""What people call: ``llm`` (``LLM.generate``, offline), ``cli`` (``minicb ...``) and ``serve`` (the
OpenAI-compatible HTTP server)."""
