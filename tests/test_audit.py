"""`ncl-pipeline audit`: the stratified sample, the page in a real headless Chromium (clicks and
keys reach answers.parquet, a reload resumes), and the estimates against the ground truth of
a real run's corpus (answered from the truth, each true figure inside its interval)."""

from __future__ import annotations

import json
import shutil
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from cli_job import invoke_cli
from label_fixtures import table_quality

from pipeline.clients.read import read_labels
from pipeline.core.audit import DEGREES, weighted_auroc
from pipeline.reporting.audit import (
    AuditError,
    audit_summary,
    prepare_audit,
    read_answers,
    serve_audit,
)

pytestmark = [pytest.mark.ray]

TRUTH_ANSWER = {"clean": "match", "partial": "partial", "mismatched": "mismatch"}


@pytest.fixture()
def run(pipeline_run, tmp_path) -> Path:
    """A copy of the session's real run (its tars stay where they are)."""
    return Path(shutil.copytree(pipeline_run["run"], tmp_path / "run"))


@pytest.fixture()
def served(run):
    server = serve_audit(str(run), port=0, per_stratum=3, seed=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


def _post(url: str, key: str, answer: str) -> dict:
    request = urllib.request.Request(
        f"{url}api/answer",
        data=json.dumps({"key": key, "answer": answer}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


def test_the_sample_is_stratified_by_label_decile_seeded_and_kept(run):
    labels = read_labels(run).to_table(columns=["key", "soft_label"])
    sample = prepare_audit(str(run), per_stratum=4, seed=3)
    table = sample.table
    assert table.num_rows == 40 and table.column("item").to_pylist() == list(range(40))
    assert sorted(pc.value_counts(table.column("stratum")).field("counts").to_pylist()) == [4] * 10
    assert sum(sample.sizes.values()) == labels.num_rows
    assert max(sample.sizes.values()) - min(sample.sizes.values()) <= 1  # equal deciles
    # the lowest decile's labels lie below the highest's
    by = {h: table.filter(pc.equal(table.column("stratum"), h)) for h in (0, 9)}
    assert pc.max(by[0].column("soft_label")).as_py() <= pc.min(by[9].column("soft_label")).as_py()
    assert all(image for image in table.column("image").to_pylist())  # read from the tars
    assert all((run / "audit" / image).is_file() for image in table.column("image").to_pylist())
    again = prepare_audit(str(run), per_stratum=4, seed=3)
    assert again.table.column("key").equals(table.column("key"))
    with pytest.raises(AuditError, match=r"seed 3 \(now 4\).*--resample"):
        prepare_audit(str(run), per_stratum=4, seed=4)
    other = prepare_audit(str(run), per_stratum=4, seed=4, resample=True)
    assert not other.table.column("key").equals(table.column("key"))


def test_the_page_in_chromium_saves_each_answer_and_a_reload_resumes(served, run, tmp_path):
    from report_browser import headless_chrome
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    assert served.url.startswith("http://127.0.0.1:")
    answers = run / "audit" / "answers.parquet"
    items = served.sample.table.sort_by("item").column("key").to_pylist()

    def saved() -> dict:  # read as a user's `audit --summary` would, while the page writes
        return {row["item"]: row["answer"] for row in read_answers(str(run)).values()}

    def wait_for(driver, check):
        WebDriverWait(driver, 10).until(lambda _: check())

    with headless_chrome(tmp_path / "profile") as driver:
        driver.get(served.url)
        wait_for(driver, lambda: driver.execute_script("return document.body.dataset.ready"))
        image = driver.find_element(By.ID, "image")
        wait_for(driver, lambda: driver.execute_script("return arguments[0].naturalWidth", image))
        body = driver.find_element(By.TAG_NAME, "body")
        body.send_keys("1")  # match
        wait_for(driver, lambda: saved() == {0: "match"})
        driver.find_element(By.ID, "partial").click()
        wait_for(driver, lambda: saved() == {0: "match", 1: "partial"})
        body.send_keys("3")
        wait_for(driver, lambda: len(saved()) == 3)
        driver.refresh()  # resumes at the first pair not judged
        wait_for(driver, lambda: driver.execute_script("return document.body.dataset.ready"))
        assert driver.execute_script("return document.body.dataset.at") == "3"
        assert driver.find_element(By.ID, "progress").text.startswith(f"3 of {len(items)} judged")
        body = driver.find_element(By.TAG_NAME, "body")
        body.send_keys("\ue012")  # ArrowLeft: back to pair 3, judged again
        body.send_keys("1")
        wait_for(driver, lambda: saved().get(2) == "match")
        errors = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    assert errors == []
    table = pq.read_table(answers)
    assert table.column("key").to_pylist() == items[:3]
    assert saved() == {0: "match", 1: "partial", 2: "match"}


def test_the_server_refuses_what_is_not_the_sample(served):
    key = served.sample.table.column("key")[0].as_py()
    assert _post(served.url, key, "mismatch") == {"answered": 1}
    for body in ((key, "maybe"), ("no-such-key", "match")):
        with pytest.raises(urllib.error.HTTPError, match="400"):
            _post(served.url, *body)
    with pytest.raises(urllib.error.HTTPError, match="404"):
        urllib.request.urlopen(f"{served.url}sample.parquet", timeout=10)


def test_estimates_from_answers_given_by_the_truth_hold_the_truth(pipeline_run, run):
    """Every pair of 20 per decile answered from the ground truth through the server: the
    true precision of the kept and dropped sets and the true AUROCs lie in their intervals."""
    server = serve_audit(str(run), port=0, per_stratum=20, seed=1)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    truth_path = pipeline_run["job"].eval.ground_truth
    truth = pq.read_table(truth_path, columns=["key", "kind"])
    kind = dict(zip(truth.column("key").to_pylist(), truth.column("kind").to_pylist(), strict=True))
    try:
        for key in server.sample.table.column("key").to_pylist():
            _post(server.url, key, TRUTH_ANSWER[kind[key]])
    finally:
        server.shutdown()
    min_label = 0.5
    found = audit_summary(str(run), min_label, ("clean", "quasi_clean"))
    labels = read_labels(run).to_table(columns=["key", "soft_label", "cosine", "subset"])
    degree = np.array([DEGREES[TRUTH_ANSWER[kind[k]]] for k in labels.column("key").to_pylist()])
    soft = labels.column("soft_label").to_numpy()
    subset = np.array(labels.column("subset").to_pylist())
    kept = (soft >= min_label) & (subset != "noisy")
    judged = degree != 0.5
    true = {
        "kept_precision": degree[kept].mean(),
        "dropped_precision": degree[~kept].mean(),
        "label_auroc": table_quality(labels, truth_path, "soft_label")["auroc"],
        "cosine_auroc": weighted_auroc(
            labels.column("cosine").to_numpy()[judged], degree[judged] == 1, np.ones(judged.sum())
        ),
    }
    assert found["answered"] == 200 and found["kept_share"] == pytest.approx(kept.mean(), abs=0.1)
    for name, value in true.items():
        estimate = found[name]
        assert estimate["low"] <= value <= estimate["high"], (name, value, estimate)
        assert estimate["high"] - estimate["low"] < 0.35, (name, estimate)
    assert found["favoured"]["threshold"] in set(soft.tolist())
    code, shown = invoke_cli("audit", str(run), "--summary", "--min-label", "0.5")
    assert code == 0, shown
    assert "precision of the kept set:" in shown and "95% interval" in shown
    assert "the answers favour --min-label" in shown


def test_the_summary_before_any_answer_says_what_to_do(run):
    prepare_audit(str(run), per_stratum=2)
    with pytest.raises(AuditError, match="no answers yet; judge pairs first"):
        audit_summary(str(run), 0.0, ("clean", "quasi_clean"))
