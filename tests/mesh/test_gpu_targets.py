"""XLA:GPU target descriptions: a real device's CUDA properties give the description XLA:GPU makes of
that device, and where the spec table's differs (needs no CUDA plugin: plain data)."""
import pytest

from whalex.errors import ClusterError
from whalex.mesh.gpu_targets import TARGETS, differences, from_cuda_properties

# What CuPy's getDeviceProperties (and cudaDeviceGetAttribute for the clocks) reported on one H200 SXM.
H200 = {"name": b"NVIDIA H200", "major": 9, "minor": 0, "multiProcessorCount": 132,
        "maxThreadsPerMultiProcessor": 2048, "sharedMemPerMultiprocessor": 233472, "sharedMemPerBlockOptin": 232448,
        "l2CacheSize": 62914560, "clockRate": 1980000, "totalGlobalMem": 150109880320, "memoryClockRate": 3201000,
        "memoryBusWidth": 6016}


def test_the_recorded_h200_is_the_spec_tables():
    real = from_cuda_properties(H200)
    assert differences(TARGETS["H200-141GB"], real) == {}
    text = real.text()
    assert "l2_cache_size: 62914560" in text and "memory_bandwidth: 4814304000000" in text
    assert "cuda_compute_capability { major: 9 }" in text and 'device_description_str: "NVIDIA H200"' in text


def test_differences_name_each_field_and_both_values():
    props = dict(H200, l2CacheSize=50 * 2**20, memoryBusWidth=5120)
    found = differences(TARGETS["H200-141GB"], from_cuda_properties(props))
    assert set(found) == {"l2_bytes", "bandwidth"}
    assert found["l2_bytes"] == (62914560, 50 * 2**20)


def test_versions_reach_the_text():
    text = from_cuda_properties(H200, dnn_version=(9, 13), cuda_runtime=(13, 0)).text()
    assert "dnn_version_info { major: 9 minor: 13 }" in text and "runtime_version { major: 13 minor: 0" in text


def test_missing_properties_are_named():
    with pytest.raises(ClusterError, match="memoryClockRate"):
        from_cuda_properties({k: v for k, v in H200.items() if k != "memoryClockRate"})
