"""The sharding engine: ``fully_shard`` and everything under it. It knows nothing of CUDA graphs.

Calls go downward: hooks -> root -> unit -> parameter group / gradients -> sharded parameter,
buffers, collectives (see docs/architecture.md). ``capture_interface`` is what the graph layer
may use; ``introspect`` is the read-only view for tests and benchmarks.
"""
