"""The graph layer: capture and replay, hook reroute, ``graph_modules``, whole-step capture.

It meets the engine only through ``fsdp_graph.fsdp.capture_interface`` (the sentinel protocol,
the unit steps, the roots, the persistence check) and never imports ``fsdp_graph.steps``.
"""
