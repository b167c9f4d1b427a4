"""embed.from_embeddings: round 0 from a clip-retrieval folder (issue 36 item 4).

The folder is written here the way clip-retrieval writes it (img_emb/img_emb_<i>.npy and
text_emb/text_emb_<i>.npy in float16, metadata/metadata_<i>.parquet), from the project's own
encode path (`encode_pairs`) over the `pipeline_run` corpus with the run's round-0 model, in
parts that cross shard boundaries, with a few pairs left out and one caption changed. A run
from it gives the same published labels as `pipeline_run` (which embedded with the model), and
round-0 tables equal to its own up to float16 rounding.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.io.clip_retrieval import (
    EmbeddingLookup,
    EmbeddingsFolderError,
    open_embeddings_folder,
)

LEFT_OUT = 4  # pairs the folder lacks: the model embeds them
# float16 keeps 11 significant bits: an embedding entry (|x| < 1) is within 2^-11 of its fp32
# value, so a cosine (a sum of D such products, L2-normalised) moves by ~1e-3 at most, and a
# per-sample loss (logit scale ~14 times cosines) by ~2e-2.
EMBEDDING_ATOL, COSINE_ATOL, LOSS_ATOL = 1e-3, 2e-3, 5e-2


def _write_part(root, index: int, columns: dict, image: np.ndarray, text: np.ndarray) -> None:
    for folder in ("img_emb", "text_emb", "metadata"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    np.save(root / "img_emb" / f"img_emb_{index}.npy", image)
    np.save(root / "text_emb" / f"text_emb_{index}.npy", text)
    pq.write_table(pa.table(columns), root / "metadata" / f"metadata_{index}.parquet")


def _encode_corpus(paths: list[str], job) -> dict:
    """Every decodable pair of the shards, embedded by the job's round-0 model (view a)."""
    from pipeline.run.specs import model_specs

    return _encode_with(model_specs(job)["a"], paths)


def _encode_with(model, paths: list[str]) -> dict:
    """Every decodable pair of the shards, embedded by `model` through encode_pairs."""
    import torch

    from pipeline.io.shards import DecodedSample, decode_record, iter_shard_records
    from pipeline.models import encode_pairs, load_clip

    loaded = load_clip(model, "cpu")
    rows: dict[str, list] = {"key": [], "caption": [], "url": [], "image": [], "text": []}
    for path in sorted(paths):
        samples = [decode_record(r) for r in iter_shard_records(path)]
        samples = [s for s in samples if isinstance(s, DecodedSample)]
        for start in range(0, len(samples), 64):
            chunk = samples[start : start + 64]
            pixels = torch.stack([loaded.preprocess(s.image) for s in chunk])
            image, text, _ = encode_pairs(
                loaded, pixels, loaded.tokenizer([s.caption for s in chunk])
            )
            rows["image"].append(image.numpy().astype(np.float16))  # clip-retrieval's dtype
            rows["text"].append(text.numpy().astype(np.float16))
            rows["key"] += [s.key for s in chunk]
            rows["caption"] += [s.caption for s in chunk]
            rows["url"] += [s.url for s in chunk]
    rows["image"], rows["text"] = np.concatenate(rows["image"]), np.concatenate(rows["text"])
    return rows


def write_clip_retrieval_folder(root, rows: dict, left_out: list[int], recaptioned: int) -> None:
    """Three parts of unequal size (crossing shards), minus `left_out` rows, with the caption
    of row `recaptioned` changed (its embedding no longer belongs to the pair)."""
    keep = np.setdiff1d(np.arange(len(rows["key"])), left_out)
    captions = list(rows["caption"])
    captions[recaptioned] = "a caption of another pair"
    for index, part in enumerate(np.array_split(keep, [250, 420])):
        columns = {
            "image_path": [rows["key"][i] for i in part],
            "caption": [captions[i] for i in part],
            "url": [rows["url"][i] for i in part],
            "key": [rows["key"][i] for i in part],
        }
        _write_part(root, index, columns, rows["image"][part], rows["text"][part])


@pytest.fixture(scope="module")
def ingested_run(pipeline_run, tmp_path_factory):
    from pipeline.config import JobConfig
    from pipeline.run.runner import run_job

    root = tmp_path_factory.mktemp("ingest")
    reference = pipeline_run["job"]
    rows = _encode_corpus(pipeline_run["paths"], reference)
    left_out = [3, 151, 300, 599 - 40][:LEFT_OUT]
    write_clip_retrieval_folder(root / "emb", rows, left_out, recaptioned=10)
    dumped = reference.model_dump(mode="json")
    dumped["output"] = str(root / "run")
    dumped["embed"]["from_embeddings"] = {
        "path": str(root / "emb"),
        "model": reference.model.name,
        "pretrained": reference.model.pretrained,
    }
    job = JobConfig.model_validate(dumped)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # every record of the run, warnings included
    logger = logging.getLogger("pipeline")
    logger.addHandler(handler)
    try:
        metrics = run_job(job)
    finally:
        logger.removeHandler(handler)
    return {
        "job": job,
        "run": root / "run",
        "folder": root / "emb",
        "left_out": [rows["key"][i] for i in left_out],
        "metrics": metrics,
        "log": [record.getMessage() for record in records],
    }


def _labels(run) -> pa.Table:
    from pipeline.clients.read import read_labels

    return read_labels(str(run)).to_table().sort_by("key")


@pytest.mark.ray
def test_ingested_embeddings_give_the_labels_of_embedding(pipeline_run, ingested_run):
    mine, theirs = _labels(ingested_run["run"]), _labels(pipeline_run["run"])
    for column in ("key", "uid", "image_sha256", "soft_label", "clean_prob", "subset", "loss"):
        assert mine.column(column).equals(theirs.column(column)), column
    embed = ingested_run["metrics"]["rounds"]["0"]["embed"]
    assert embed["embedded"] == pipeline_run["metrics"]["rounds"]["0"]["embed"]["embedded"]
    assert embed["ingested"] == embed["embedded"] - LEFT_OUT - 1
    assert embed["not_ingested"] == {"caption_differs": 1, "not_in_folder": LEFT_OUT}
    said = [line for line in ingested_run["log"] if "no usable embedding" in line]
    assert len(said) == 1 and "were embedded by the model" in said[0], ingested_run["log"]
    assert ingested_run["left_out"][0] in said[0]


@pytest.mark.ray
def test_round0_tables_match_the_model_within_float16(pipeline_run, ingested_run):
    from pipeline.io.layout import RunLayout
    from pipeline.io.tables import embedding_matrix

    for path in pipeline_run["paths"]:
        shard = path.rsplit("/", 1)[-1].removesuffix(".tar")
        mine = pq.read_table(RunLayout(str(ingested_run["run"])).embeddings(0, shard))
        theirs = pq.read_table(RunLayout(str(pipeline_run["run"])).embeddings(0, shard))
        for column in ("key", "uid", "image_sha256", "caption"):
            assert mine.column(column).equals(theirs.column(column)), column
        for column in ("image_embedding_a", "text_embedding_a"):
            diff = embedding_matrix(mine.column(column)) - embedding_matrix(theirs.column(column))
            assert np.abs(diff).max() <= EMBEDDING_ATOL, column
        for column, atol in (("cosine_a", COSINE_ATOL), ("loss_i2t_a", LOSS_ATOL)):
            np.testing.assert_allclose(
                mine[column].to_numpy(), theirs[column].to_numpy(), atol=atol
            )
        norms = np.linalg.norm(embedding_matrix(mine.column("image_embedding_a")), axis=1)
        np.testing.assert_allclose(norms, 1.0, atol=2e-3)  # L2-normalised, as encode_pairs's


def test_a_rewritten_folder_is_ingested_again(ingested_run):
    from pipeline.run.status import predict_rerun

    run, job = str(ingested_run["run"]), ingested_run["job"]
    assert predict_rerun(run, job).decisions["round0/embed"].reuse
    meta = ingested_run["folder"] / "metadata" / "metadata_2.parquet"
    table = pq.read_table(meta)
    pq.write_table(table.slice(0, table.num_rows), meta, compression="zstd")  # other bytes
    decision = predict_rerun(run, job).decisions["round0/embed"]
    assert not decision.reuse and "from_embeddings changed" in decision.reason


def test_validate_describes_the_folder(ingested_run, tmp_path):
    import yaml
    from typer.testing import CliRunner

    from pipeline.cli import app

    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(ingested_run["job"].model_dump(mode="json")))
    result = CliRunner().invoke(app, ["validate", str(job_file)])
    assert result.exit_code == 0, result.output
    assert f"ok: embeddings {ingested_run['folder']}: 578 pairs in 3 parts, 128-dimensional" in (
        result.output
    )


# ------------------------------------------------------------------------- refusals, no Ray


def _job(tmp_path, model: str, pretrained: str | None, folder: str):
    from pipeline.config import load_job

    path = tmp_path / "job.yaml"
    path.write_text(
        f"name: t\ninput: {{shards: {tmp_path}/x.tar}}\noutput: {tmp_path}/run\n"
        "model: {name: ncl-tiny, pretrained: null}\n"
        f"embed: {{from_embeddings: {{path: {folder}, model: {model}, "
        f"pretrained: {pretrained}}}}}\n"
    )
    return load_job(path)


def test_embeddings_of_another_model_are_refused(tmp_path):
    from pipeline.config import JobConfigError

    with pytest.raises(JobConfigError, match="made by ViT-B-32 .laion2b_s34b_b79k. but the job's"):
        _job(tmp_path, "ViT-B-32", "laion2b_s34b_b79k", str(tmp_path))
    assert _job(tmp_path, "ncl-tiny", "null", str(tmp_path)).embed.from_embeddings.model


def test_under_sources_the_folder_names_its_source(tmp_path):
    import yaml

    from pipeline.config import JobConfigError, load_job

    def job(input_section: dict, source: str | None):
        given = {"path": str(tmp_path), "model": "ncl-tiny", "pretrained": None}
        model = {"name": "ncl-tiny", "pretrained": None}
        body = {"name": "t", "input": input_section, "output": str(tmp_path / "run")}
        body |= {"model": model, "embed": {"from_embeddings": given | {"source": source}}}
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(body))
        return load_job(tmp_path / "job.yaml")

    sources = {"sources": [{"name": "cc3m", "shards": "a.tar"}, {"name": "cc12m", "shards": "b"}]}
    with pytest.raises(JobConfigError, match="must name the source .* one of cc3m, cc12m"):
        job(sources, None)
    assert job(sources, "cc12m").embed.from_embeddings.source == "cc12m"
    with pytest.raises(JobConfigError, match="names a source but the job has input.shards"):
        job({"shards": "a.tar"}, "cc3m")


def test_embeddings_of_another_dimension_are_refused(tmp_path):
    from pipeline.run.specs import embeddings_source

    vectors = np.ones((2, 8), np.float16)
    _write_part(tmp_path / "emb", 0, {"key": ["a", "b"], "caption": ["x", "y"]}, vectors, vectors)
    job = _job(tmp_path, "ncl-tiny", "null", str(tmp_path / "emb"))
    with pytest.raises(
        EmbeddingsFolderError, match="8-dimensional embeddings but ncl-tiny embeds in 128"
    ):
        embeddings_source(job)


def test_folder_layout_problems_name_the_file(tmp_path):
    vectors = np.ones((3, 4), np.float32)
    _write_part(tmp_path, 0, {"key": ["a", "b", "c"]}, vectors, vectors)
    _write_part(tmp_path, 1, {"key": ["d", "e"]}, vectors, vectors)
    with pytest.raises(
        EmbeddingsFolderError, match="metadata_1.parquet has 2 rows but .*img_emb_1"
    ):
        open_embeddings_folder(str(tmp_path))
    (tmp_path / "text_emb" / "text_emb_1.npy").unlink()
    with pytest.raises(EmbeddingsFolderError, match="part 1 has no text_emb_1.npy"):
        open_embeddings_folder(str(tmp_path))
    with pytest.raises(EmbeddingsFolderError, match="holds no clip-retrieval embeddings"):
        open_embeddings_folder(str(tmp_path / "elsewhere"))


def test_lookup_reads_rows_by_key_and_refuses_ambiguous_ones(tmp_path):
    rng = np.random.default_rng(0)
    image, text = rng.normal(size=(2, 900, 4)).astype(np.float16)
    keys = [f"{i:06d}" for i in range(900)]
    keys[899] = keys[0]  # a key on two rows: neither is used
    for index, part in enumerate(np.array_split(np.arange(900), [600])):
        columns = {"image_path": [keys[i] for i in part], "caption": [f"c{i}" for i in part]}
        _write_part(tmp_path, index, columns, image[part], text[part])
    folder = open_embeddings_folder(str(tmp_path))
    assert (folder.dim, folder.dtype, folder.key_column) == (4, "float16", "image_path")
    lookup = EmbeddingLookup(folder)
    wanted = [5, 598, 601, 10, 880, 1]  # across parts, apart by more than a ranged read skips
    found, why = lookup.find(
        [keys[i] for i in wanted] + ["nope", keys[0]], [f"c{i}" for i in wanted] + ["", "c0"]
    )
    assert why == [""] * 6 + ["not_in_folder", "repeated_key"]
    got_image, got_text = lookup.read(found[:6])
    assert np.array_equal(got_image, image[wanted]) and np.array_equal(got_text, text[wanted])
    _, why = lookup.find([keys[5]], ["another caption"])
    assert why == ["caption_differs"]


def test_under_sources_only_the_named_sources_shards_are_ingested(tmp_path):
    """embed_shard itself (no Ray): shards of the folder's source read it by their keys
    without the '<source>/' prefix; another source's shard is embedded by the model."""
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.config import EmbedConfig
    from pipeline.data.synthetic import make_corpus
    from pipeline.io.shards import source_location
    from pipeline.models import ModelSpec, load_clip
    from pipeline.stages.embed import EmbedSpec, embed_shard

    make_corpus(tmp_path / "c", samples=32, samples_per_shard=16, test_samples=0, image_size=32)
    model = ModelSpec("ncl-tiny", None, "fp32", seed=0)
    rows = _encode_with(model, [str(tmp_path / "c" / "00000.tar")])
    write_clip_retrieval_folder(tmp_path / "emb", rows, left_out=[], recaptioned=0)
    spec = EmbedSpec(
        output=str(tmp_path / "run"),
        round_index=0,
        views={"a": model},
        seed=0,
        embed=EmbedConfig(batch_size=8, decode="cpu"),
        source=open_embeddings_folder(str(tmp_path / "emb")),
        source_name="cc3m",
    )
    models = {"a": load_clip(model, "cpu")}
    with ThreadPoolExecutor(2) as pool:
        mine = embed_shard(
            source_location("cc3m", str(tmp_path / "c" / "00000.tar")), spec, models, pool
        )
        other = embed_shard(
            source_location("cc12m", str(tmp_path / "c" / "00001.tar")), spec, models, pool
        )
    assert (mine["embedded"], mine["ingested"]) == (16, 15)  # row 0 was recaptioned
    assert json.loads(mine["not_ingested"]) == {
        "reasons": {"caption_differs": 1},
        "examples": ["cc3m/000000000"],
    }
    assert (other["embedded"], other["ingested"], json.loads(other["not_ingested"])["reasons"]) == (
        16,
        0,
        {},
    )
