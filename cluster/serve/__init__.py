"""iterserve on Ray Serve: the application (:mod:`.app`, whose ``build_app`` is
the ``import_path`` of a Serve config: ``iterserve.cluster.serve.app:build_app``),
the HTTP ingress (:mod:`.ingress`), its view of the engine replicas
(:mod:`.replicas`) and how it routes among them (:mod:`.routing`), what each
process reserves (:mod:`.resources`) and ``iterserve serve`` (:mod:`.cli`)."""
