"""The scheduler: its output contract (`output.py`), waiting queue (`request_queue.py`), stop rules (`stop.py`)
and the step-by-step decisions (`scheduler.py`)."""
