"""Co-teaching end to end on a real local Ray: warm-up, a round of two epochs, published labels.

One round keeps this module's shared run short (a round costs an embed pass, two label passes
and a Ray Train start-up); several rounds in a row, each on the models of the one before, are
what `tests/test_demo.py` runs (two rounds of the demo job)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from label_fixtures import table_quality
from log_capture import console_output
from shared_run import PAIRS_PER_SHARD, SHARDS, copy_run, load

from pipeline.clients.read import read_labels
from pipeline.core.partition.decisions import SUBSETS
from pipeline.io.layout import BASELINE_SUMMARY, RunLayout
from pipeline.run.runner import resolve_inputs, run_job
from pipeline.run.specs import coteach_spec

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SPS_ROUND = (
    "labels.method=sps",
    "labels.sps.eps1=0.9",
    "labels.sps.beta=0.0",
    "train.rounds=1",
    "train.epochs_per_round=2",
    "train.sps.quasi_start=0.0",
    "train.sps.noisy_start=0.5",
    "train.report_to=tensorboard",
)


@pytest.fixture(scope="module")
def corpus(warmed_run) -> Path:
    return warmed_run["corpus"]


@pytest.fixture(scope="module")
def sps_run(warmed_run, corpus, tmp_path_factory) -> dict:
    """The session's shared warmed run, continued by a co-teaching round of SPS."""
    out = copy_run(warmed_run["out"], tmp_path_factory.mktemp("sps_run") / "run")
    job = load(corpus, out, *SPS_ROUND)
    with console_output() as lines:
        metrics = run_job(job)
    return {"job": job, "out": out, "metrics": metrics, "log": "\n".join(lines)}


def test_each_round_writes_both_views_tables_and_trains(sps_run):
    out, metrics = sps_run["out"], sps_run["metrics"]
    rounds = metrics["rounds"]
    for r in ("1", "2"):  # round 1 trains; round 2 labels the final models
        for view in ("a", "b"):
            assert len(list((out / "rounds" / r / f"labels_{view}").glob("*.parquet"))) == SHARDS
            reported = rounds[r][f"labels_{view}"]["quality"]["sps"]["auroc"]
            table = read_labels(out / "rounds" / r / f"labels_{view}").to_table()
            truth = sps_run["job"].eval.ground_truth
            assert reported == pytest.approx(table_quality(table, truth, "soft_label")["auroc"])
    train = rounds["1"]["train"]
    assert set(train["views"]) == {"A", "B"} and train["round_kind"] == "labels"
    assert set(rounds["1"]["retrieval"]) == {"A", "B", "A+B"}
    assert (out / "rounds" / "1" / "checkpoints" / "A" / "model.pt").exists()
    assert "train" not in rounds["2"]
    # SPS schedule (quasi_start 0, noisy_start 0.5 of 2 epochs): proxies from epoch 2 on.
    for view in ("A", "B"):
        first, second = rounds["1"]["train"]["views"][view]["history"]
        assert first["proxy_pairs"] == 0 and 0 < first["reliable_pairs"] < first["pairs"]
        assert 0 < first["mean_weight"] < 1
        # beta 0: every noisy pair whose proxy is similar at all trains as a proxy pair (with
        # the default 0.5 these random-init models' y_p = P^ x S never passes the cut).
        assert 0 < second["proxy_pairs"] < second["pairs"] == first["pairs"]
    assert "co-teaching (coteach, labels sps)" in sps_run["log"]


def test_the_console_and_tensorboard_show_the_same_epochs_counted_from_one(sps_run):
    from test_tracking import read_scalars

    log, rounds = sps_run["log"], sps_run["metrics"]["rounds"]
    assert "round1/embed: recomputed because it has not run before" in log
    history = rounds["1"]["train"]["views"]["A"]["history"]
    for epoch, record in enumerate(history, start=1):
        assert (
            f"round 1 A epoch {epoch}/2: mean InfoNCE {record['loss']:.3f} (all pairs, "
            f"unweighted), objective weighted InfoNCE + SPS consistency {record['objective']:.3f}"
        ) in log
    scalars = read_scalars(sps_run["out"] / "tensorboard")
    assert scalars["round1/mean_infonce/A"] == [
        (epoch, pytest.approx(r["loss"])) for epoch, r in enumerate(history, start=1)
    ]
    assert [step for step, _ in scalars["round0/mean_infonce/B"]] == [1]  # the warm-up
    median = scalars["round1/pair_weight_p50/B"]
    assert len(median) == 2 and all(0 <= value <= 1 for _, value in median)
    table = {row["labels_round"]: row for row in sps_run["metrics"]["coteaching"]}
    assert scalars["labels/auroc_a"] == [
        (r, pytest.approx(table[r]["auroc_a"])) for r in sorted(table)
    ]
    assert [step for step, _ in scalars["heldout/rsum_A+B"]] == [0, 1]


def test_views_differ_and_each_model_trains_on_the_other_views_labels(sps_run):
    out = sps_run["out"]
    a = pq.read_table(out / "rounds" / "1" / "labels_a" / "00000.parquet")
    b = pq.read_table(out / "rounds" / "1" / "labels_b" / "00000.parquet")
    assert a.column("key").equals(b.column("key"))
    assert not np.array_equal(a.column("clean_prob").to_numpy(), b.column("clean_prob").to_numpy())
    meta = {k.decode(): v.decode() for k, v in a.schema.metadata.items()}
    assert meta["ncl.round"] == "1" and meta["ncl.view"] == "a"
    assert json.loads(meta["ncl.mixture"])["fits"]  # lineage: the mixture parameters
    assert meta.get("ncl.labelling_view") == "b"  # SPS: P^ from the model that trains on it
    job = sps_run["job"]
    spec = coteach_spec(job, RunLayout(job.output), resolve_inputs(job), 1, {})
    by_name = {v.name: v for v in spec.views}
    assert by_name["A"].labels_dir.endswith("rounds/1/labels_b")
    assert by_name["B"].labels_dir.endswith("rounds/1/labels_a")
    assert by_name["B"].proxies_dir.endswith("rounds/1/sps_proxies_a")
    assert spec.coteach_epochs == (0, 2)


def test_published_labels_are_the_mean_of_the_final_round_views(sps_run):
    out = sps_run["out"]
    final = read_labels(out).to_table().sort_by([("shard", "ascending"), ("key", "ascending")])
    views = [
        read_labels(out / "rounds" / "2" / f"labels_{v}")
        .to_table()
        .sort_by([("shard", "ascending"), ("key", "ascending")])
        for v in ("a", "b")
    ]
    assert final.num_rows == views[0].num_rows == PAIRS_PER_SHARD * SHARDS
    expected = 0.5 * (
        views[0].column("soft_label").to_numpy() + views[1].column("soft_label").to_numpy()
    )
    np.testing.assert_allclose(final.column("soft_label").to_numpy(), expected, rtol=1e-6)
    subset = np.array(final.column("subset").to_pylist())
    a_subset = np.array(views[0].column("subset").to_pylist())
    b_subset = np.array(views[1].column("subset").to_pylist())
    assert np.all((subset == "clean") == ((a_subset == "clean") & (b_subset == "clean")))
    assert set(final.column("round").to_pylist()) == {2}
    table = sps_run["metrics"]["coteaching"]
    assert [row["models"] for row in table] == [0, 1]
    truth = sps_run["job"].eval.ground_truth
    combined = table_quality(final, truth, "soft_label")["auroc"]
    assert table[-1]["auroc_combined"] == pytest.approx(combined)
    assert all(0 <= row["rsum_A+B"] <= 600 for row in table)  # six recalls in %
    assert (out / "report" / "index.html").exists()


def test_every_round_has_label_free_diagnostics(sps_run):
    """Kept share, subset shares, the views' agreement and the change from the round before,
    as the closing table and metrics.json show them, against the label tables themselves."""
    from scipy.stats import spearmanr

    out, rows = sps_run["out"], sps_run["metrics"]["coteaching"]

    def views(r):
        tables = [
            read_labels(out / "rounds" / str(r) / f"labels_{v}").to_table().sort_by("key")
            for v in ("a", "b")
        ]
        soft = [t.column("soft_label").to_numpy().astype(np.float64) for t in tables]
        codes = [
            np.array([SUBSETS.index(s) for s in t.column("subset").to_pylist()]) for t in tables
        ]
        return soft, codes

    (soft1, codes1), (soft2, codes2) = views(1), views(2)
    published2 = (soft2[0] + soft2[1]) / 2
    subset1, subset2 = np.maximum(*codes1), np.maximum(*codes2)
    first, last = rows
    assert last["kept_fraction"] == pytest.approx(np.mean(subset2 < 2))  # export defaults
    assert last["subset_shares"]["noisy"] == pytest.approx(np.mean(subset2 == 2))
    assert last["views_subset_agreement"] == pytest.approx(np.mean(codes2[0] == codes2[1]))
    assert last["views_spearman"] == pytest.approx(spearmanr(*soft2).statistic, abs=0.02)
    assert first["change_spearman"] is None and first["changed_subset_share"] is None
    assert last["changed_subset_share"] == pytest.approx(np.mean(subset1 != subset2))
    published1 = (soft1[0] + soft1[1]) / 2
    assert last["change_spearman"] == pytest.approx(
        spearmanr(published1, published2).statistic, abs=0.02
    )
    for row in rows:
        assert 0 < row["noise_a"] < 1 and 0 < row["noise_b"] < 1
        assert row["val_rsum_A"] is None  # the shared job sets no eval.val_shards
    log = sps_run["log"]
    assert "kept clean quasi noisy views rho same subset changed rho prev" in " ".join(log.split())
    assert "after round 1 " in log and "with the ground truth (label AUROC per view)" in log


def _one_round_after(sps_run: dict, out: Path, mode: str, **train):
    """The SPS run's job in another train.mode with one epoch, run into a copy of its output:
    the run state reuses the round-0 embed pass, the warm-up and round 1's embed and label
    passes (none depends on the mode) and recomputes round 1's training and what follows."""
    shutil.copytree(sps_run["out"], out)
    shutil.rmtree(out / "rounds" / "2")  # the SPS models' final labels: not this job's
    job = sps_run["job"]
    update = {"mode": mode, "epochs_per_round": 1, **train}
    return job.model_copy(update={"output": str(out), "train": job.train.model_copy(update=update)})


def test_vanilla_and_oracle_use_the_same_trainer(sps_run, corpus, tmp_path):
    vanilla = load(corpus, tmp_path / "vanilla", "train.mode=vanilla", "train.rounds=1")
    spec = coteach_spec(vanilla, RunLayout(vanilla.output), resolve_inputs(vanilla), 1, {})
    assert all(v.labels_dir is None and v.target == "weights" for v in spec.views)

    oracle = _one_round_after(sps_run, tmp_path / "oracle", "oracle")
    with console_output() as lines:
        metrics = run_job(oracle)
    said = "\n".join(lines)
    assert "round0/warmup: reused" in said and "round1/labels_a: reused" in said
    layout = RunLayout(oracle.output)
    truth = pq.read_table(corpus / "ground_truth.parquet", columns=["key", "kind"])
    clean = {k for k, kind in zip(*truth.to_pydict().values(), strict=True) if kind == "clean"}
    clean &= set(pq.read_table(Path(layout.round_dir(0), "embeddings")).column("key").to_pylist())
    written = set()
    for path in Path(layout.baseline_dir(1, "oracle")).glob("*.parquet"):
        written |= set(pq.read_table(path).column("key").to_pylist())
    assert written == clean
    trained = metrics["rounds"]["1"]["train"]["views"]["A"]
    batches = len(clean) // 32  # clean pairs only, full batches of 32
    assert trained["steps"] == batches


def test_cosine_filter_trains_on_the_highest_cosine_pairs(sps_run, tmp_path):
    """train.mode cosine_filter: the same trainer on the pairs the warmed models' mean cosine
    ranks highest, as many as the fitted clean weight says (or train.filter_fraction)."""
    job = _one_round_after(sps_run, tmp_path / "filter", "cosine_filter", filter_fraction=0.5)
    metrics = run_job(job)
    layout = RunLayout(job.output)
    folder = Path(layout.baseline_dir(1, "cosine_filter"))
    record = json.loads((folder / BASELINE_SUMMARY).read_text())
    assert record["run_state"]["stage"] == "round1/filter"
    kept = sum(record["kept"].values())
    embedded = pq.read_table(Path(layout.round_dir(1), "embeddings")).select(
        ["key", "cosine_a", "cosine_b"]
    )
    assert kept == round(0.5 * embedded.num_rows)
    scores = dict(
        zip(
            embedded.column("key").to_pylist(),
            (
                0.5
                * (embedded.column("cosine_a").to_numpy() + embedded.column("cosine_b").to_numpy())
            ),
            strict=True,
        )
    )
    chosen = set()
    for path in folder.glob("*.parquet"):
        chosen |= set(pq.read_table(path).column("key").to_pylist())
    assert min(scores[k] for k in chosen) >= max(s for k, s in scores.items() if k not in chosen)
    trained = metrics["rounds"]["1"]["train"]["views"]["A"]
    assert trained["steps"] == kept // 32  # only the kept pairs, full batches of 32


@pytest.mark.parametrize(
    ("scorer", "scored_round", "columns"),
    [("initial", 0, ["cosine_a"]), ("warmed", 1, ["cosine_a", "cosine_b"])],
)
def test_the_filter_scores_with_the_initial_or_the_warmed_models(
    sps_run, tmp_path, scorer, scored_round, columns
):
    """train.filter_scorer initial keeps the top pairs by the job's starting model (round 0's
    one view, scored once: DataComp's filter); warmed by the mean of the two warmed models."""
    from pipeline.run.specs import write_baseline

    job = _one_round_after(
        sps_run, tmp_path / scorer, "cosine_filter", filter_fraction=0.4, filter_scorer=scorer
    )
    layout = RunLayout(job.output)
    folder = layout.baseline_dir(1, "cosine_filter")
    summary = write_baseline(job, layout, "filter", 1, resolve_inputs(job), folder)
    assert summary["scorer"] == scorer
    kept = summary["kept"]
    embedded = pq.read_table(Path(layout.round_dir(scored_round), "embeddings"))
    mean = sum(embedded.column(c).to_numpy() for c in columns) / len(columns)
    scores = dict(zip(embedded.column("key").to_pylist(), mean, strict=True))
    chosen = set()
    for path in Path(folder).glob("*.parquet"):
        chosen |= set(pq.read_table(path).column("key").to_pylist())
    assert len(chosen) == sum(kept.values()) == round(0.4 * len(scores))
    assert min(scores[k] for k in chosen) >= max(s for k, s in scores.items() if k not in chosen)
