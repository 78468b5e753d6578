"""What every Triton kernel module of the package shares: device helpers (`common.py`) and the
launch configurations that fit the device (`launch.py`)."""
