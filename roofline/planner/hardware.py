"""Datasheet figures of the accelerators the planner knows, and the numeric precisions it prices.

A :class:`GPUSpec` holds what the roofline needs: memory capacity, HBM bandwidth, dense
tensor-core peaks per compute dtype and the per-direction bandwidth of the interconnect that
all-reduces run over. Figures are the vendors' dense (not 2:4-sparse) peaks; HBM capacities are
binary (an "80 GB" H100 holds 80 GiB); bandwidths and FLOP/s are decimal. ``custom_gpu`` builds a
spec from explicit numbers and ``GPUSpec.derated`` scales the peaks to measured efficiencies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GiB = 1 << 30
GB = 10**9
TB = 10**12

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "fp16": 2.0,
    "bf16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}
"""Bytes per element of each storage precision (int4 packs two elements per byte)."""

_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "e4m3": "fp8",
    "float8": "fp8",
    "w4": "int4",
    "w8": "int8",
}


def canonical_dtype(name: str) -> str:
    """Normalise a precision name (``bfloat16`` -> ``bf16``); raise on unknown names."""
    key = name.strip().lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown precision {name!r}; choose from {sorted(DTYPE_BYTES)}")
    return key


def dtype_bytes(name: str) -> float:
    return DTYPE_BYTES[canonical_dtype(name)]


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator's datasheet figures (dense peaks, per GPU)."""

    name: str
    memory_bytes: int
    """HBM / GDDR capacity."""
    hbm_bandwidth_bytes_per_s: float
    bf16_flops_per_s: float
    """Dense bf16/fp16 tensor-core peak (fp32 accumulate)."""
    fp8_flops_per_s: float | None
    """Dense fp8 tensor-core peak; None where the chip has no fp8 tensor cores."""
    int8_ops_per_s: float | None
    interconnect: str
    interconnect_bandwidth_bytes_per_s: float
    """Per direction, per GPU (half of NVIDIA's bidirectional NVLink figure)."""
    interconnect_latency_s: float = 1e-6
    """Per-hop latency of one collective step (alpha in the alpha-beta model): about 1 us
    over NVLink / Infinity Fabric with NCCL's low-latency protocol, 5 us over PCIe."""

    def peak_flops_per_s(self, compute_dtype: str) -> float:
        """Dense peak for GEMMs in ``compute_dtype``; fp8/int8 fall back to bf16 where absent,
        fp32 runs as TF32 at half the bf16 rate, int4 weights compute in bf16 (W4A16)."""
        dt = canonical_dtype(compute_dtype)
        if dt == "fp8" and self.fp8_flops_per_s:
            return self.fp8_flops_per_s
        if dt == "int8" and self.int8_ops_per_s:
            return self.int8_ops_per_s
        if dt == "fp32":
            return self.bf16_flops_per_s / 2
        return self.bf16_flops_per_s

    def ridge_point_flops_per_byte(self, compute_dtype: str = "bf16") -> float:
        """Arithmetic intensity above which a kernel is compute-bound."""
        return self.peak_flops_per_s(compute_dtype) / self.hbm_bandwidth_bytes_per_s

    def derated(
        self, bandwidth_efficiency: float = 1.0, compute_efficiency: float = 1.0
    ) -> GPUSpec:
        """The same GPU with its peaks scaled to the fractions a real kernel reaches."""
        for label, eff in (("bandwidth", bandwidth_efficiency), ("compute", compute_efficiency)):
            if not 0.0 < eff <= 1.0:
                raise ValueError(f"{label} efficiency must be in (0, 1], got {eff}")

        def scale(v: float | None) -> float | None:
            return None if v is None else v * compute_efficiency

        return replace(
            self,
            name=f"{self.name} ({bandwidth_efficiency:.0%} BW, {compute_efficiency:.0%} FLOP/s)",
            hbm_bandwidth_bytes_per_s=self.hbm_bandwidth_bytes_per_s * bandwidth_efficiency,
            bf16_flops_per_s=self.bf16_flops_per_s * compute_efficiency,
            fp8_flops_per_s=scale(self.fp8_flops_per_s),
            int8_ops_per_s=scale(self.int8_ops_per_s),
        )


def _spec(name, mem_gib, bw_tb, bf16_tf, fp8_tf, int8_tops, link, link_gb, lat_us=1.0) -> GPUSpec:
    return GPUSpec(
        name=name,
        memory_bytes=int(mem_gib * GiB),
        hbm_bandwidth_bytes_per_s=bw_tb * TB,
        bf16_flops_per_s=bf16_tf * TB,
        fp8_flops_per_s=None if fp8_tf is None else fp8_tf * TB,
        int8_ops_per_s=None if int8_tops is None else int8_tops * TB,
        interconnect=link,
        interconnect_bandwidth_bytes_per_s=link_gb * GB,
        interconnect_latency_s=lat_us * 1e-6,
    )


GPUS: dict[str, GPUSpec] = {
    "h100": _spec("H100 SXM 80GB", 80, 3.35, 989.4, 1978.9, 1978.9, "NVLink4 900 GB/s", 450),
    "h200": _spec("H200 SXM 141GB", 141, 4.8, 989.4, 1978.9, 1978.9, "NVLink4 900 GB/s", 450),
    "a100-40gb": _spec("A100 SXM 40GB", 40, 1.555, 312.0, None, 624.0, "NVLink3 600 GB/s", 300),
    "a100-80gb": _spec("A100 SXM 80GB", 80, 2.039, 312.0, None, 624.0, "NVLink3 600 GB/s", 300),
    "b200": _spec("B200 180GB", 180, 8.0, 2250.0, 4500.0, 4500.0, "NVLink5 1.8 TB/s", 900),
    "mi300x": _spec("MI300X 192GB", 192, 5.3, 1307.4, 2614.9, 2614.9, "Infinity Fabric", 448),
    "l40s": _spec("L40S 48GB", 48, 0.864, 362.05, 733.0, 733.0, "PCIe4 x16", 32, 5.0),
    "rtx4090": _spec("RTX 4090 24GB", 24, 1.008, 165.2, 330.3, 660.6, "PCIe4 x16", 32, 5.0),
}
"""Datasheet table. Peaks are dense; RTX 4090 bf16/fp8 are the fp32-accumulate rates."""

_GPU_ALIASES = {
    "h100-sxm": "h100",
    "h100sxm": "h100",
    "h200-sxm": "h200",
    "a100": "a100-80gb",
    "a100-40": "a100-40gb",
    "a100-80": "a100-80gb",
    "a100_40gb": "a100-40gb",
    "a100_80gb": "a100-80gb",
    "4090": "rtx4090",
    "rtx-4090": "rtx4090",
    "mi300": "mi300x",
}


def get_gpu(name: str) -> GPUSpec:
    key = name.strip().lower()
    key = _GPU_ALIASES.get(key, key)
    if key not in GPUS:
        raise ValueError(
            f"unknown GPU {name!r}; choose from {sorted(GPUS)} or give explicit figures"
        )
    return GPUS[key]


def custom_gpu(
    name: str,
    memory_gib: float,
    bandwidth_gb_per_s: float,
    bf16_tflops: float,
    fp8_tflops: float | None = None,
    interconnect_gb_per_s: float = 32.0,
) -> GPUSpec:
    """A GPU (or CPU) described by explicit figures, for hardware missing from the table."""
    if memory_gib <= 0 or bandwidth_gb_per_s <= 0 or bf16_tflops <= 0:
        raise ValueError("memory, bandwidth and FLOP/s must be positive")
    return _spec(
        name,
        memory_gib,
        bandwidth_gb_per_s / 1000,
        bf16_tflops,
        fp8_tflops,
        None,
        "custom",
        interconnect_gb_per_s,
        5.0,
    )
