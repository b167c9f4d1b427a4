"""`ncl-pipeline export`: the driver (`driver.py`) and its per-shard Ray tasks (`tasks.py`)."""
