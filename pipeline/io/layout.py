"""The run directory (docs/architecture.md §4.3): one place that names every path a stage
reads or writes.

Contract paths: `labels/_CURRENT` naming the published generation `labels/gen-<n>/`, which holds
`<shard>.parquet` (`pipeline.io.generations`; an older run's flat `labels/<shard>.parquet` still
reads), `quarantine/<shard>.parquet`, `metrics.json`, `manifest.json`, `report/`. Everything under
`rounds/<r>/` is intermediate and may change.
`output` may be a local path or an fsspec URL; paths are joined with '/' for both.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BASELINE_SUMMARY",
    "INDEX_DESCRIPTION",
    "LABEL_PASS_SUMMARY",
    "LEASE_NAME",
    "MANIFEST_NAME",
    "LABELS_POINTER",
    "LABELS_GENERATION_PREFIX",
    "RUN_STATE_FIELD",
    "STAGE_KEY_META",
    "RunLayout",
    "run_dir_of",
]

# Embeddings footer: the run-state key its shard was embedded under (pipeline.run.state), the
# embed pass's per-shard completion marker.
STAGE_KEY_META = "ncl.stage_key"
# A stage's completion summary (the keys check's `_keys.json`, `train_summary.json`, a label
# pass's or the published generation's `_label_pass.json`): the run-state key it was computed
# under ({stage, key, config, inputs}), written with the summary in the stage's last write, so a
# damaged manifest.json is rebuilt from the outputs (pipeline.run.manifest).
RUN_STATE_FIELD = "run_state"
# labels/: each publish writes a new generation folder gen-<n>/, then switches this pointer (one
# line naming it) so a reader never sees two runs' rows together (pipeline.io.generations).
LABELS_POINTER = "_CURRENT"
LABELS_GENERATION_PREFIX = "gen-"
# Marker and summary files. A leading '_' keeps them out of dataset readers (pyarrow, Spark).
MANIFEST_NAME = "manifest.json"  # the run's record (pipeline.run.manifest)
LEASE_NAME = "_lease.json"  # the run writing the directory (pipeline.run.lease)
# A label pass's summary beside its tables, and the published generation's (written last)
LABEL_PASS_SUMMARY = "_label_pass.json"
BASELINE_SUMMARY = "_baseline.json"  # the oracle's or cosine filter's tables' summary, last
INDEX_DESCRIPTION = "_index.json"  # what a round's index folder holds


@dataclass(frozen=True)
class RunLayout:
    output: str  # run directory, local path or fsspec URL, without a trailing '/'

    def __post_init__(self) -> None:
        object.__setattr__(self, "output", self.output.rstrip("/"))

    def _join(self, *parts: object) -> str:
        return "/".join([self.output, *(str(p) for p in parts)])

    @property
    def manifest(self) -> str:
        return self._join(MANIFEST_NAME)

    @property
    def lease(self) -> str:
        """The lease of the run writing this directory (pipeline.run.lease); absent when
        none runs."""
        return self._join(LEASE_NAME)

    @property
    def metrics(self) -> str:
        return self._join("metrics.json")

    @property
    def quarantine_dir(self) -> str:
        return self._join("quarantine")

    def quarantine(self, shard: str) -> str:
        return self._join("quarantine", f"{shard}.parquet")

    @property
    def labels_dir(self) -> str:
        """The published labels' root: its pointer and generation folders."""
        return self._join("labels")

    @property
    def labels_pointer(self) -> str:
        return self._join("labels", LABELS_POINTER)

    def labels_generation(self, number: int) -> str:
        return self._join("labels", f"{LABELS_GENERATION_PREFIX}{number}")

    @property
    def rounds_dir(self) -> str:
        return self._join("rounds")

    def round_dir(self, round_index: int) -> str:
        return self._join("rounds", round_index)

    @property
    def keys_summary(self) -> str:
        """The corpus-wide key check's summary (written last by it)."""
        return self._join("rounds", 0, "_keys.json")

    def embeddings_dir(self, round_index: int) -> str:
        return self._join("rounds", round_index, "embeddings")

    def embeddings(self, round_index: int, shard: str) -> str:
        return self._join("rounds", round_index, "embeddings", f"{shard}.parquet")

    @property
    def report_dir(self) -> str:
        return self._join("report")

    def mixture(self, round_index: int, view: str) -> str:
        """Every mixture fitted by a view's label pass (BMM, GMM, per-direction GMMs)."""
        return self._join("rounds", round_index, f"mixture_{view}.json")

    def labels_round_dir(self, round_index: int, view: str) -> str:
        """A round's label tables made from `view`'s embeddings (what its peer trains on)."""
        return self._join("rounds", round_index, f"labels_{view}")

    def sps_proxies_dir(self, round_index: int, view: str) -> str:
        """SPS proxy pairs of the noisy set (extra training pairs), one table per shard."""
        return self._join("rounds", round_index, f"sps_proxies_{view}")

    def index_dir(self, round_index: int, view: str) -> str:
        """FAISS index shards of `view`'s label pass (`<role>_<modality>_<shard>.faiss`) and
        `_index.json` describing them (docs/architecture.md §2)."""
        return self._join("rounds", round_index, f"index_{view}")

    def checkpoint_dir(self, round_index: int, view: str) -> str:
        return self._join("rounds", round_index, "checkpoints", view)

    def model_checkpoint(self, round_index: int, view: str) -> str:
        """The trained weights of a view: what the next round's embed pass loads."""
        return self._join("rounds", round_index, "checkpoints", view, "model.pt")

    def resume_state(self, round_index: int, view: str) -> str:
        """Model + optimizer + step + RNG + warm-up state of a view, for resuming a killed run."""
        return self._join("rounds", round_index, "checkpoints", view, "resume.pt")

    def best_model(self, round_index: int, view: str) -> str:
        return self._join("rounds", round_index, "checkpoints", view, "best_model.pt")

    def train_error(self, round_index: int) -> str:
        """An error of the round's training that a retry cannot fix (a shard changed, an
        unusable GPU): written by the worker that hit it, read by every retried worker group
        and by the driver (`pipeline.stages.train.driver`)."""
        return self._join("rounds", round_index, "checkpoints", "train_error.json")

    def baseline_dir(self, round_index: int, mode: str) -> str:
        """The label tables of train.mode oracle (per round) or cosine_filter (round 1's)."""
        return self._join("rounds", round_index, f"labels_{mode}")

    def train_summary(self, round_index: int) -> str:
        """Written last by training (the round's summary; whether the round is complete and
        current is the run state's record in manifest.json, `pipeline.run.state`)."""
        return self._join("rounds", round_index, "checkpoints", "train_summary.json")


def run_dir_of(label_folder: str) -> str:
    """The run directory of a folder of label tables: the parent of `labels/` (or of
    `labels/gen-<n>/`), or of `rounds/<r>/labels_<view>/`."""
    parts = label_folder.rstrip("/").split("/")
    if len(parts) >= 3 and parts[-3] == "rounds":
        return "/".join(parts[:-3])
    if len(parts) >= 2 and parts[-2] == "labels" and parts[-1].startswith(LABELS_GENERATION_PREFIX):
        return "/".join(parts[:-2])
    return "/".join(parts[:-1])
