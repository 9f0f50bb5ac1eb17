"""What this CPU's vector units can do, read from the CPU itself (``/proc/cpuinfo`` on Linux;
torch's capability string only as a fallback): AVX-512F, AVX512-BF16, AMX-BF16, AVX512-FP16.

The implementation lives in :mod:`app._cpu` (below every other module, so the CPU kernels and
the layer read it without importing the platforms package); this is its public face.
"""

from app._cpu import (
    CPUINFO_PATH,
    FEATURE_NAMES,
    CpuFeatures,
    detect_cpu_features,
    parse_cpuinfo,
    read_cpu_features,
)

__all__ = ["CPUINFO_PATH", "FEATURE_NAMES", "CpuFeatures", "detect_cpu_features",
           "parse_cpuinfo", "read_cpu_features"]
