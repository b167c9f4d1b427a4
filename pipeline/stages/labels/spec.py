"""`LabelSpec`: one label pass (round, view, shards) with the job's validated config sections."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config import IndexConfig, LabelsConfig, MixtureConfig
from pipeline.core.labels import LabelMethod, get_method
from pipeline.io.layout import RunLayout

__all__ = ["LabelSpec"]


@dataclass(frozen=True)
class LabelSpec:
    """Everything a label pass needs; plain data, so Ray ships it to every task.

    The method settings, the mixture and the index layout are the job's own validated config
    sections (their defaults and checks live in `pipeline.config` only); the rest says where
    the pass reads and writes.
    """

    output: str  # run directory (embeddings are read from rounds/<round_index>/embeddings)
    round_index: int
    view: str  # embeddings column suffix, e.g. "a": the view whose mixture partitions
    shards: tuple[str, ...]  # shard names in a fixed order: it defines the global sample ids
    out_dir: str  # where <shard>.parquet label tables go
    labels: LabelsConfig = field(default_factory=LabelsConfig)
    mixture: MixtureConfig = field(default_factory=MixtureConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    ground_truth: str | None = None  # ground_truth.parquet -> label quality in the summary
    job_hash: str = ""  # written into every table (lineage)
    model_id: str | None = None  # None: taken from the embeddings' metadata
    shard_paths: tuple[str, ...] = ()  # source tars aligned with `shards` (report thumbnails)
    seed: int = 0  # in-batch anchors and P^ batches
    query_batch: int = 1024  # queries per neighbour search
    select_fetch_limit: int = 65536  # radix select fetches the rows in play below this count
    proxies_dir: str | None = None  # SPS proxy tables; None -> rounds/<r>/sps_proxies_<view>
    # The view that trains on these labels. Methods with `uses_trainee_view` (SPS) label with
    # its embeddings and losses while `view` partitions (docs/methods.md §7.4). None: `view`.
    trainee_view: str | None = None
    write_index: bool = True  # persist the FAISS shards under rounds/<r>/index_<view>/
    # The run-state key this pass is computed under, recorded in `_label_pass.json`
    # (`pipeline.io.layout.RUN_STATE_FIELD`); None outside a run.
    run_state: dict | None = None
    # Each modality's corpus mean (image, text), (D,) float64, when the method centres
    # (`LabelMethod.centred`): set by the driver from the pass's own rows, never by a job.
    embedding_means: tuple | None = None

    def __post_init__(self) -> None:
        if not self.shards:
            raise ValueError("a label pass needs at least one shard")
        if len(set(self.shards)) != len(self.shards):
            raise ValueError("shard names must be unique")
        if self.shard_paths and len(self.shard_paths) != len(self.shards):
            raise ValueError("shard_paths must be empty or aligned with shards")
        if self.query_batch < 1 or self.select_fetch_limit < 1:
            raise ValueError("query_batch and select_fetch_limit must be >= 1")

    @property
    def method(self) -> LabelMethod:
        return get_method(self.labels.method)

    @property
    def params(self):
        """The method's own settings section (`labels.bicro`, ...), None when it has none."""
        return getattr(self.labels, self.labels.method, None)

    @property
    def mixture_kind(self) -> str:
        """The mixture whose posterior partitions: the method's own (SPS: the GMM, as its paper)
        or the job's `mixture.kind`."""
        return self.method.mixture or self.mixture.kind

    @property
    def labelling_view(self) -> str:
        """The view whose embeddings and losses make the labels (SPS: the trainee's)."""
        if self.method.uses_trainee_view and self.trainee_view:
            return self.trainee_view
        return self.view

    def embeddings_path(self, shard: str) -> str:
        return RunLayout(self.output).embeddings(self.round_index, shard)

    @property
    def competitors(self) -> bool:
        """The mixture sees each pair's InfoNCE against its corpus competitors (§1.7)."""
        return self.labels.loss_negatives == "competitors"

    def competitor_loss_path(self, shard: str) -> str:
        """The pass's competitor losses of a shard (loss_i2t, loss_t2i; `_`: not a label table)."""
        return f"{self.out_dir}/_competitor_loss/{shard}.parquet"

    def with_labels(self, **changes) -> LabelSpec:
        """A copy with `labels` settings changed (validated): `with_labels(method="rcr")`."""
        from dataclasses import replace

        merged = {**self.labels.model_dump(), **changes}
        return replace(self, labels=LabelsConfig.model_validate(merged))

    @classmethod
    def from_job(
        cls,
        job,
        *,
        round_index: int,
        view: str,
        shard_paths: list[str] | tuple[str, ...],
        out_dir: str | None = None,
        model_id: str | None = None,
        trainee_view: str | None = None,
    ) -> LabelSpec:
        """The label pass of a `JobConfig` over `shard_paths` (tar paths).

        Args:
            job: the validated `pipeline.config.JobConfig`.
            round_index: round whose embeddings are labelled.
            view: embeddings view ("a", "b").
            shard_paths: the job's resolved input shards (their basenames name the tables).
            out_dir: label table folder; default `rounds/<r>/labels_<view>`.
            model_id: override of the model id recorded in the tables.
            trainee_view: the view that trains on the labels (see the field).
        """
        from pipeline.io.shards import shard_name

        layout = RunLayout(job.output)
        return cls(
            output=layout.output,
            round_index=round_index,
            view=view,
            shards=tuple(shard_name(p) for p in shard_paths),
            shard_paths=tuple(shard_paths),
            out_dir=out_dir or layout.labels_round_dir(round_index, view),
            labels=job.labels,
            mixture=job.mixture,
            index=job.index,
            ground_truth=job.eval.ground_truth,
            job_hash=job.stage_hash(),
            model_id=model_id,
            seed=job.seed,
            trainee_view=trainee_view,
        )
