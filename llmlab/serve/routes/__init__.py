"""The HTTP routes, one module each: ``info`` (``/health``, ``/metrics``, ``/v1/models``),
``completions`` (``/v1/completions``), ``chat`` (``/v1/chat/completions``). Each handler finds
what it needs in the app's :class:`~llmlab.serve.context.ServingContext`;
:func:`llmlab.serve.app.build_app` registers them."""
