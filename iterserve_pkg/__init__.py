"""iterserve: an LLM serving cluster built around an iteration-level scheduler.

The sub-packages map to the repository's top-level folders:
``iterserve.scheduler`` (pure-Python scheduling core), ``iterserve.kernels``
(Triton kernels and torch references), ``iterserve.workers`` (model runtime),
``iterserve.cluster`` (Ray actors, Serve app, CLI), ``iterserve.bench``
(load generator, policy comparison, simulator).
"""

__version__ = "0.1.0"
