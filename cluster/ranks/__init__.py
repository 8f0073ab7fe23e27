"""An engine's ranks: one worker actor per tensor-parallel rank (:mod:`.worker`),
the group that places, starts and restarts them (:mod:`.group`), the step channel
the plans and results cross (:mod:`.step_channel`), and what builds each rank's
executor (:mod:`.executors`)."""
