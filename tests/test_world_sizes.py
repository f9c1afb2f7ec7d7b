"""Larger worlds on CPU (gloo): 4 and 8 ranks, where the GPU machines lent so far have 2 GPUs.

The small model's sizes (rows of 10, 23, 37) do not divide 4 or 8, so shards pad, and at 8 ranks
some ranks hold no row of a parameter at all. At each world size: sharded training against the
replicated single-process reference; an FSDP2 script switched by its import against FSDP2 itself;
and at 8 ranks HSDP on 2 × 4 and 4 × 2 meshes, each against the same reference (so against plain
FSDP over 8 as well), and a DCP checkpoint written at 2 ranks (ours and FSDP2's) resumed at 8.
"""

from __future__ import annotations

import pytest
from test_checkpoint import _resume_each, checkpoints  # noqa: F401 (a fixture)
from test_fsdp2_api import _switched_by_import
from test_parity import _train_and_compare

from dist_harness import run_ranks

pytestmark = pytest.mark.cpu_only  # CPU and gloo on any machine: CI runs it; the GPU suite need not

TIMEOUT_S = 400  # eight processes share the CI machine's two cores


@pytest.mark.parametrize("world_size", [4, 8])
def test_parity_with_replicated_reference_at_larger_world_sizes(world_size):
    run_ranks(_train_and_compare, world_size, "adamw", None, 1e-5, 1e-6, {}, timeout=TIMEOUT_S)


@pytest.mark.parametrize("world_size", [4, 8])
def test_an_fsdp2_script_switched_by_its_import_trains_the_same_at_larger_world_sizes(world_size):
    run_ranks(_switched_by_import, world_size, timeout=TIMEOUT_S)


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)])
def test_hsdp_on_eight_ranks_matches_the_replicated_reference(mesh_shape):
    run_ranks(_train_and_compare, 8, "adamw", None, 1e-5, 1e-6, {}, {}, mesh_shape, timeout=TIMEOUT_S)


def test_a_dcp_checkpoint_reshards_from_two_ranks_to_eight(checkpoints):  # noqa: F811
    run_ranks(_resume_each, 8, checkpoints, [("fsdp_graph", "fsdp_graph"), ("fsdp2", "fsdp_graph")], backend="gloo",
              timeout=TIMEOUT_S)
