from vldist.kernels.region_affinity import region_affinity, region_affinity_torch

__all__ = ["region_affinity", "region_affinity_torch"]
