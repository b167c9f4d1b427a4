"""The label stage: Ray orchestration of the label pass (the methods live in pipeline.core).

- `spec.py`: `LabelSpec`, the pass and the job's config sections it reads.
- `shard_tasks.py`: the per-shard steps (ranges, histograms, counts, selects, index rows).
- `index_actors.py`: the FAISS index held by Ray actors and persisted.
- `label_task.py`: labelling one shard and writing its tables.
- `driver.py`: `run_label_pass`, the order of the steps.
- `resources.py`: the Ray options of its tasks and actors, and the preflight's requests.
"""

from pipeline.stages.labels.driver import SUMMARY_NAME, run_label_pass
from pipeline.stages.labels.spec import LabelSpec

__all__ = ["SUMMARY_NAME", "LabelSpec", "run_label_pass"]
