"""Run examples/benchmark.py with the root's gradients never homed in the graphs' pool (probe)."""
import os
import runpy
import sys

import fsdp_graph.graphs.capture as capture

capture.roots_homed_after = lambda units_per_graph: {}
sys.argv = [os.path.join("examples", "benchmark.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
