"""Model FLOPs utilisation: the share of the GPUs' dense bf16 peak a training run turns into model math.

The convention is the common 6 N FLOPs per token (forward 2 N, backward 4 N, N the parameters;
attention's score and value products are left out), so MFU compares runs of one model, not a
count of every kernel's work.
"""

from __future__ import annotations

import torch

PEAK_BF16_FLOPS = {  # dense bf16, per GPU; the first name found in torch.cuda.get_device_name wins
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,  # SXM ("NVIDIA H100 80GB HBM3")
}


def peak_bf16_flops(device: torch.device) -> float | None:
    """This GPU's dense bf16 peak, or None for a device not in the table (no MFU is reported)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def mfu(n_params: int, tokens_per_s: float, world_size: int, device: torch.device) -> float | None:
    """Model FLOPs per second per GPU over the GPU's peak (None where the peak is unknown)."""
    peak = peak_bf16_flops(device)
    return None if peak is None else 6 * n_params * tokens_per_s / (world_size * peak)
