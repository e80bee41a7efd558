"""The watchers of a run (:class:`densetrain.train.watchers.Watcher` subclasses, built by ``make_watchers`` in
:mod:`densetrain.train.setup`): :mod:`.guard` (non-finite steps, loss spikes; :mod:`.spikes` the per-rank
partials), :mod:`.replicas` (replica checksums), :mod:`.updates` (update norms), :mod:`.watchdog` (slow and
hung ranks, heartbeats), :mod:`.probe` (duplicate data, per-source loss trends), :mod:`.health` (hardware
health checks), :mod:`.curve` (the ladder's off_curve alarm), :mod:`.faults` (rehearsal), :mod:`.collect`
(garbage collection after optimizer steps). The loop only sees their verdicts."""
