"""The OpenAI-compatible HTTP API: request models, handlers, streaming, errors.

Nothing here knows about Ray Serve: the handlers talk to the engine through the
small :class:`~iterserve.cluster.openai.generation.EngineClient` interface, which
``iterserve.cluster.serve.app`` implements over a Serve deployment handle.
"""
