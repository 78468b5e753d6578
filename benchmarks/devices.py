"""What the benchmark needs to know about its device: the dense bf16 matrix rate behind its
"% of peak" column, and the L2 size that decides whether inputs stay cache-resident.

Rates are looked up by device name (first match wins), then by compute capability (the
architecture's datasheet rate); an unknown device, or a CPU, has none and its "% of peak" stays
empty. The H200's rate was measured (a bf16 GEMM reaches about 790 TF/s of its 989 datasheet
figure); the others are datasheet dense (non-sparse) rates.
"""

import dataclasses
import re

import torch


@dataclasses.dataclass(frozen=True)
class PeakRate:
    tflops: float
    source: str


_MEASURED_GH100 = "measured on an H200 (bf16 GEMM); datasheet 989"
_BY_NAME = (
    (r"\bH200\b", 790.0, _MEASURED_GH100),
    (r"\bH100\b.*\bPCIe\b", 756.0, "datasheet"),
    (r"\bH100\b|\bH800\b", 790.0, _MEASURED_GH100 + " (same GH100 tensor cores and clocks as the H200)"),
    (r"\bH20\b", 148.0, "datasheet"),
    (r"\bGB200\b", 2500.0, "datasheet"),
    (r"\bB200\b", 2250.0, "datasheet"),
    (r"\bA100\b|\bA800\b", 312.0, "datasheet"),
    (r"\bL40S\b", 362.0, "datasheet"),
)
_BY_CAPABILITY = {(8, 0): 312.0, (9, 0): 989.0, (10, 0): 2250.0}


def peak_for(name: str, capability: tuple[int, int] | None) -> PeakRate | None:
    """The dense bf16 rate of a GPU called `name` with compute `capability`, or None if unknown."""
    for pattern, tflops, source in _BY_NAME:
        if re.search(pattern, name):
            return PeakRate(tflops, f"{source} ({name})")
    if capability in _BY_CAPABILITY:
        major, minor = capability
        return PeakRate(_BY_CAPABILITY[capability], f"datasheet rate of compute capability {major}.{minor} ({name})")
    return None


def device_peak(device: torch.device) -> PeakRate | None:
    """The dense bf16 rate of `device`; None on a CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    return peak_for(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))


def l2_bytes(device: torch.device) -> int | None:
    """The device's L2 cache size in bytes; None on a CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).L2_cache_size
