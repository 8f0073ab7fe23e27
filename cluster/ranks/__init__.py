"""An engine's ranks: one rank actor per tensor-parallel rank (:mod:`.actor`),
the group that places, starts and restarts them (:mod:`.group`), the step channel
the plans and results cross (:mod:`.step_channel`), and what builds each rank's
executor (:mod:`.executors`)."""
