"""Test configuration. The suite checks correctness, not speed: compile XLA's CPU code at a low
optimization level (about 2x faster compiles), and expose fake CPU devices for shard_map tests."""

import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=4"
os.environ["XLA_FLAGS"] = _flags.strip()
