"""A replica over several devices: rank 0 (the server's runtime) and the ranks it starts and supervises.

- :mod:`.sequence_parallel`: Ulysses-style attention over head shards (the all-to-alls around attention).
- :mod:`.rank`: what a rank other than 0 runs (its own runner over its head shard, driven by rank 0).
- :mod:`.liveness`: each other rank's heartbeat, and rank 0's watchdog that kills a rank that stops.
- :mod:`.transfer`: a session's snapshot, its heads joined from every rank a window of blocks at a time.
- :mod:`.runtime`: rank 0's runtime (:class:`~.runtime.DistributedRuntime`), the server's view of the replica.

Nothing in ``app/`` imports this package: the server asks for a runtime by its settings and gets one.
"""
