"""Which catalogue profile describes a GPU, from the name CUDA reports (torch.cuda.get_device_name).

`profiles calibrate` on CUDA takes the datasheet peaks and, on a one-GPU machine, the
links from that profile. The names CUDA reports are not the catalogue's (an H100 SXM5
reports "NVIDIA H100 80GB HBM3"), so the match is a short table of patterns, each
checked against the names nvidia-smi prints (catalogue sources, e.g. h100-sxm.yaml's
"nvidia-smi dumps: NVIDIA H100 80GB HBM3"); first match wins, so the more specific
patterns come first. No match: None, and the calibration uses its measured peaks.
"""

from __future__ import annotations

import re

from pipeplan.hardware_profiles.profile import HardwareProfile

# (pattern on the CUDA device name, catalogue profile name)
CUDA_NAMES: tuple[tuple[str, str], ...] = (
    (r"H100.*PCIe", "h100-pcie"),
    (r"H100", "h100-sxm"),  # "NVIDIA H100 80GB HBM3" is the SXM5 part; "H100 NVL" is closest to it too
    (r"H200", "h200"),
    (r"B200", "b200"),
    (r"A100.*PCIE.*80|A100.*80.*PCIe", "a100-80gb-pcie"),
    (r"A100.*80", "a100-80gb-sxm"),
    (r"A100", "a100-40gb-sxm"),
    (r"A10G", "a10g"),
    (r"\bL4\b", "l4"),
    (r"RTX 4090", "rtx-4090"),
    (r"\bT4\b", "t4"),
    (r"\bP40\b", "p40"),  # "Tesla P40"
    (r"TITAN X \(Pascal\)", "titan-x-pascal"),  # not the later "TITAN Xp" (3840 cores)
    (r"GTX 1080 Ti", "gtx-1080-ti"),
    (r"V100.*32", "v100-32gb-sxm2"),
    (r"V100", "v100-16gb-sxm2"),
)


def catalog_name(device_name: str) -> str | None:
    """The catalogue profile name for a CUDA device name, or None."""
    return next((n for pattern, n in CUDA_NAMES if re.search(pattern, device_name, re.IGNORECASE)), None)


def catalog_match(device_name: str) -> HardwareProfile | None:
    """The catalogue profile for a CUDA device name, or None."""
    from pipeplan.hardware_profiles.loader import catalog_profiles

    name = catalog_name(device_name)
    return next((p for p in catalog_profiles() if p.name == name), None) if name else None
