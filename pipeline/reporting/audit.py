"""`ncl-pipeline audit RUN`: a person judges a stratified sample of a run's published pairs in
the browser, and the answers estimate how good the labels are (`pipeline.core.audit`).

Contract:
- `prepare_audit(run, per_stratum, seed)` draws the sample once (`per_stratum` pairs per label
  decile of the published labels, seeded, in a shuffled order so the page never shows the
  labels' order) and writes `RUN/audit/sample.parquet` and the images (`RUN/audit/images/`,
  from the source tars). A later call reuses it; a sample of other published labels (another
  generation) or of another size or seed is refused unless `resample`, which moves nothing
  but starts the sample and the answers anew.
- `serve_audit(run, port)` serves the page on 127.0.0.1 only. Each answer (match / partial /
  mismatch) is written to `RUN/audit/answers.parquet` (key, item, answer, answered_at) at
  once, atomically; a reload of the page resumes at the first pair not yet judged.
- `audit_summary(run, min_label, subsets)` reads the answers and the sample and estimates,
  at the export's selection, the precision of the kept and of the dropped set, the AUROC of
  the labels and of the plain cosine on the same sample (95% intervals), and the threshold
  the answers favour; `format_summary` is what the CLI prints.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.core.audit import (
    ANSWERS,
    DEGREES,
    audit_estimates,
    audit_strata,
    favoured_threshold,
    stratified_sample,
)
from pipeline.errors import UserError

__all__ = [
    "AUDIT_STRATA",
    "AuditError",
    "audit_summary",
    "format_summary",
    "prepare_audit",
    "serve_audit",
]

logger = logging.getLogger(__name__)

AUDIT_STRATA = 10  # label deciles
IMAGE_SIZE = 384  # the longer side of the images shown
SAMPLE_NAME, ANSWERS_NAME, PAGE_NAME = "sample.parquet", "answers.parquet", "index.html"
# The page (static: captions reach it as text through the DOM, never as markup).
_PAGE = (Path(__file__).parent / "audit_page.html").read_text(encoding="utf-8")
ANSWERS_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=False),
        pa.field("item", pa.int32(), nullable=False),
        pa.field("answer", pa.string(), nullable=False),
        pa.field("answered_at", pa.timestamp("s", tz="UTC"), nullable=False),
    ]
)


class AuditError(UserError, ValueError):
    """The run has no published labels, or the audit folder holds another sample."""


def _folder(run: str) -> str:
    return f"{str(run).rstrip('/')}/audit"


def _labels(run: str):
    """The run's published labels (a dataset) and the generation's name."""
    from pipeline.clients.read import LabelTableError, labels_folder_url, read_labels

    try:
        dataset = read_labels(run)
    except LabelTableError as exc:
        raise AuditError(f"{run}: no published labels to audit ({exc})") from None
    return dataset, labels_folder_url(run).rstrip("/").rsplit("/", 1)[-1]


def _draw(dataset, per_stratum: int, seed: int) -> tuple[pa.Table, dict[int, int]]:
    """The sampled rows, shuffled (the page's order), and each stratum's size."""
    import pyarrow.compute as pc

    labels = dataset.to_table(columns=["soft_label"]).column("soft_label").to_numpy()
    strata = audit_strata(labels, AUDIT_STRATA)
    sizes = {int(h): int(n) for h, n in zip(*np.unique(strata, return_counts=True), strict=True)}
    rows = stratified_sample(strata, per_stratum, seed)
    order = np.random.default_rng(seed + 1).permutation(len(rows))  # the page's order
    rows = rows[order]
    columns = ["key", "shard", "caption", "soft_label", "cosine", "subset"]
    parts, start = [], 0  # one file at a time: the driver holds the sampled rows only
    for fragment in dataset.get_fragments():
        n = fragment.count_rows()
        inside = rows[(rows >= start) & (rows < start + n)]
        if len(inside):
            part = fragment.to_table(columns=columns).take(pa.array(inside - start))
            parts.append((inside, part))
        start += n
    position = {int(r): i for i, r in enumerate(rows)}
    table = pa.concat_tables([part for _, part in parts])
    at = np.concatenate([inside for inside, _ in parts])
    table = table.take(pa.array(np.argsort([position[int(r)] for r in at], kind="stable")))
    table = table.set_column(
        table.schema.get_field_index("subset"),
        "subset",
        pc.cast(table.column("subset"), pa.string()),
    )
    table = table.append_column("item", pa.array(np.arange(len(rows)), pa.int32()))
    table = table.append_column("stratum", pa.array(strata[rows], pa.int16()))
    return table, sizes


@dataclass(frozen=True)
class AuditSample:
    table: pa.Table  # item, key, shard, caption, soft_label, cosine, subset, stratum, image
    sizes: dict[int, int]  # pairs per stratum in the corpus
    meta: dict[str, Any]  # generation, per_stratum, seed, pairs


def _read_sample(folder: str) -> AuditSample | None:
    from pipeline.io.tables import file_exists, read_table

    path = f"{folder}/{SAMPLE_NAME}"
    if not file_exists(path):
        return None
    table = read_table(path)
    meta = json.loads((table.schema.metadata or {}).get(b"ncl.audit", b"{}"))
    sizes = {int(h): int(n) for h, n in meta.pop("sizes", {}).items()}
    return AuditSample(table.replace_schema_metadata(None), sizes, meta)


def prepare_audit(
    run: str, per_stratum: int = 10, seed: int = 0, resample: bool = False
) -> AuditSample:
    """The run's audit sample, drawn and written once (see the module contract)."""
    import fsspec

    from pipeline.io.tables import remove_path, write_table_atomic
    from pipeline.reporting.report import label_shard_paths, write_thumbnails

    if per_stratum < 1:
        raise AuditError(f"--per-decile {per_stratum}: judge at least 1 pair per decile")
    dataset, generation = _labels(run)
    folder = _folder(run)
    wanted = {"generation": generation, "per_stratum": per_stratum, "seed": seed}
    found = _read_sample(folder)
    if found is not None and not resample:
        differs = {k: (found.meta.get(k), v) for k, v in wanted.items() if found.meta.get(k) != v}
        if not differs:
            return found
        shown = ", ".join(f"{k} {old} (now {new})" for k, (old, new) in differs.items())
        raise AuditError(
            f"{folder}/{SAMPLE_NAME} is the sample of other labels or settings ({shown}); "
            "rerun with --resample to draw a new one (its answers are then discarded), or with "
            "the sample's own --per-decile and --seed"
        )
    for name in (SAMPLE_NAME, ANSWERS_NAME, "images"):
        remove_path(f"{folder}/{name}")
    table, sizes = _draw(dataset, per_stratum, seed)
    fs, _ = fsspec.core.url_to_fs(folder)
    fs.makedirs(f"{folder}/images", exist_ok=True)
    keys, shards = table.column("key").to_pylist(), table.column("shard").to_pylist()
    wanted_images: dict[str, list[str]] = {}
    for key, shard in zip(keys, shards, strict=True):
        wanted_images.setdefault(shard, []).append(key)
    images = write_thumbnails(
        wanted_images, label_shard_paths(dataset), fs, folder, "images", IMAGE_SIZE
    )
    table = table.append_column("image", pa.array([images.get(k) for k in keys], pa.string()))
    meta = {**wanted, "pairs": int(dataset.count_rows()), "sizes": sizes}
    schema = table.schema.with_metadata({"ncl.audit": json.dumps(meta)})
    write_table_atomic(
        table.replace_schema_metadata(schema.metadata), f"{folder}/{SAMPLE_NAME}", schema
    )
    with fs.open(f"{folder}/{PAGE_NAME}", "w") as handle:
        handle.write(_PAGE)
    meta.pop("sizes")
    return AuditSample(table, sizes, meta)


def read_answers(run: str) -> dict[str, dict[str, Any]]:
    """key -> {"item", "answer", "answered_at"} of every answer given so far."""
    from pipeline.io.tables import file_exists, read_table

    path = f"{_folder(run)}/{ANSWERS_NAME}"
    if not file_exists(path):
        return {}
    return {row.pop("key"): row for row in read_table(path).to_pylist()}


def _write_answers(run: str, answers: dict[str, dict[str, Any]]) -> None:
    from pipeline.io.tables import write_table_atomic

    rows = sorted(answers.items(), key=lambda kv: kv[1]["item"])
    table = pa.table(
        {
            "key": [k for k, _ in rows],
            "item": [v["item"] for _, v in rows],
            "answer": [v["answer"] for _, v in rows],
            "answered_at": [v["answered_at"] for _, v in rows],
        },
        schema=ANSWERS_SCHEMA,
    )
    write_table_atomic(table, f"{_folder(run)}/{ANSWERS_NAME}", ANSWERS_SCHEMA)


class AuditServer:
    """The audit page and its answers on 127.0.0.1 (`serve_audit`); `url`, `serve_forever`,
    `shutdown`."""

    def __init__(self, run: str, sample: AuditSample, port: int = 0):
        self.run, self.sample = run, sample
        self.lock = threading.Lock()
        self.answers = read_answers(run)
        self.items = {
            row["key"]: row
            for row in sample.table.select(["item", "key", "caption", "image"]).to_pylist()
        }
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"

    def state(self) -> dict[str, Any]:
        with self.lock:
            answers = {k: v["answer"] for k, v in self.answers.items()}
        return {"items": sorted(self.items.values(), key=lambda r: r["item"]), "answers": answers}

    def answer(self, key: str, answer: str) -> int:
        if key not in self.items or answer not in ANSWERS:
            raise ValueError(f"unknown pair {key!r} or answer {answer!r}")
        with self.lock:
            stamp = {"item": self.items[key]["item"], "answer": answer,
                     "answered_at": time.time()}  # fmt: skip
            self.answers[key] = stamp
            _write_answers(self.run, self._stamped())
            return len(self.answers)

    def _stamped(self) -> dict[str, dict[str, Any]]:
        from datetime import datetime, timezone

        out = {}
        for key, value in self.answers.items():
            at = value["answered_at"]
            if not isinstance(at, datetime):
                at = datetime.fromtimestamp(at, timezone.utc)
            out[key] = {**value, "answered_at": at}
        return out

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _handler(server: AuditServer):
    import fsspec

    folder = _folder(server.run)
    fs, _ = fsspec.core.url_to_fs(folder)
    images = {row["image"] for row in server.items.values() if row["image"]}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format, *args):  # noqa: A002 - the stdlib's name
            logger.debug("audit: " + format % args)

        def _send(self, code: int, body: bytes, kind: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802 - the stdlib's name
            path = self.path.split("?", 1)[0].lstrip("/")
            if path in ("", PAGE_NAME):
                self._send(200, _PAGE.encode(), "text/html; charset=utf-8")
            elif path == "api/state":
                self._send(200, json.dumps(server.state()).encode(), "application/json")
            elif path in images:  # only the sample's own images: no other file is served
                with fs.open(f"{folder}/{path}", "rb") as handle:
                    self._send(200, handle.read(), "image/png")
            else:
                self._send(404, b"not found", "text/plain")

        def do_POST(self):  # noqa: N802
            if self.path != "/api/answer":
                self._send(404, b"not found", "text/plain")
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                count = server.answer(str(body.get("key")), str(body.get("answer")))
            except (ValueError, json.JSONDecodeError) as exc:
                self._send(400, str(exc).encode(), "text/plain")
                return
            self._send(200, json.dumps({"answered": count}).encode(), "application/json")

    return Handler


def serve_audit(run: str, port: int = 0, per_stratum: int = 10, seed: int = 0,
                resample: bool = False) -> AuditServer:  # fmt: skip
    """The audit page's server for `run` on 127.0.0.1:`port` (0: a free port), not started."""
    return AuditServer(run, prepare_audit(run, per_stratum, seed, resample), port)


def audit_summary(run: str, min_label: float, subsets: tuple[str, ...], seed: int = 0) -> dict:
    """What the answers estimate at the selection `min_label` / `subsets` (the export's rule);
    raises AuditError when nothing has been judged."""
    from pipeline.io.labels import kept_filter

    sample = _read_sample(_folder(run))
    answers = read_answers(run)
    if sample is None or not answers:
        raise AuditError(
            f"{_folder(run)}: no answers yet; judge pairs first with `ncl-pipeline audit {run}`"
        )
    table = sample.table.filter(
        pa.array([k in answers for k in sample.table.column("key").to_pylist()])
    )
    keys = table.column("key").to_pylist()
    kept_keys = set(table.filter(kept_filter(min_label, subsets)).column("key").to_pylist())
    degree = np.array([DEGREES[answers[k]["answer"]] for k in keys])
    kept = np.array([k in kept_keys for k in keys])
    labels = table.column("soft_label").to_numpy().astype(np.float64)
    cosine = table.column("cosine").to_numpy().astype(np.float64)
    stratum = table.column("stratum").to_numpy().astype(np.int64)
    out = audit_estimates(degree, kept, labels, cosine, stratum, sample.sizes, seed)
    answered = {int(h): int((stratum == h).sum()) for h in np.unique(stratum)}
    weight = np.array([sample.sizes[int(h)] / answered[int(h)] for h in stratum])
    out["favoured"] = favoured_threshold(degree, labels, weight, np.unique(labels))
    out["answers"] = {
        name: int(sum(answers[k]["answer"] == name for k in keys)) for name in ANSWERS
    }
    out.update(
        sampled=int(sample.table.num_rows), pairs=sample.meta.get("pairs"), min_label=min_label,
        subsets=list(subsets), per_stratum=sample.meta.get("per_stratum"),
        seed=sample.meta.get("seed"), generation=sample.meta.get("generation"),
    )  # fmt: skip
    return out


def format_summary(run: str, summary: dict) -> str:
    """The summary as the CLI prints it."""

    def figure(name: str, digits: int = 2) -> str:
        value = summary[name]
        if value["estimate"] is None:
            return "not estimable from these answers"
        interval = (
            f" (95% interval {value['low']:.{digits}f}-{value['high']:.{digits}f})"
            if value["low"] is not None
            else ""
        )
        return f"{value['estimate']:.{digits}f}{interval}"

    counts = ", ".join(f"{summary['answers'][a]} {a}" for a in ANSWERS)
    kept_share = summary["kept_share"]
    lines = [
        f"audit of {run}: {summary['answered']} of {summary['sampled']} sampled pairs judged "
        f"({counts}); {summary['per_stratum']} per label decile of {summary['pairs']:,} pairs, "
        f"seed {summary['seed']}, labels {summary['generation']}",
        f"kept at --min-label {summary['min_label']:g} --subset {','.join(summary['subsets'])}"
        + (
            f" (estimated {100 * kept_share:.1f}% of the corpus):"
            if kept_share is not None
            else ":"
        ),
        f"  precision of the kept set:    {figure('kept_precision')}",
        f"  precision of the dropped set: {figure('dropped_precision')}",
        "  (precision: the share of matching pairs, a partial match counting half)",
        f"AUROC, match vs mismatch on the same sample: labels {figure('label_auroc', 3)}; "
        f"plain cosine {figure('cosine_auroc', 3)}",
    ]
    favoured = summary.get("favoured")
    if favoured:
        lines.append(
            f"the answers favour --min-label {favoured['threshold']:.3f} (estimated F1 "
            f"{favoured['f1']:.2f}: precision {favoured['precision']:.2f}, recall "
            f"{favoured['recall']:.2f})"
        )
    return "\n".join(lines)
