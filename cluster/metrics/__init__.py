"""An engine's metrics: its series (:mod:`.engine`), what turns its events into
them (:mod:`.recorder`), the hub that gathers every replica's for the ingress's
``/metrics`` (:mod:`.hub`), and the optional mirror on Ray's own metrics agent
(:mod:`.ray_export`)."""
