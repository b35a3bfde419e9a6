"""Running one engine over several devices: tensor parallelism (`tensor_parallel.py`)."""
