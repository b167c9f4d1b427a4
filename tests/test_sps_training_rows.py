"""Proxy pairs in the trainer's data path (docs/methods.md §10.3): SPS's and assign's rematches
(target rematch) train in both directions, and rows that share an image or a text source carry
the same group ids (no Ray: the Ray Data UDF is called directly on real tars and Parquet
tables)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from shard_fixtures import noisy_jpeg_bytes, write_tar

from pipeline.core.coteach import Phase
from pipeline.io.decode import DecodeOptions
from pipeline.io.labels import SPS_PROXIES_SCHEMA
from pipeline.models import ModelSpec, load_transforms
from pipeline.stages.train.data import read_training_batches, source_id, text_proxy_pairs
from pipeline.stages.train.spec import ViewSpec

# shard 00000: n0 noisy (image proxy: r1's caption; text proxy: r1's image), n1 noisy with the
# same image proxy, q0 reliable. shard 00001: r1 reliable (the proxies' source), r2 reliable.
SHARDS = {
    "00000": [
        ("n0", "noisy caption zero", "noisy"),
        ("n1", "noisy one", "noisy"),
        ("q0", "reliable q zero", "clean"),
    ],
    "00001": [("r1", "reliable r one", "clean"), ("r2", "reliable r two", "clean")],
}
PROXIES = {  # key -> image_proxy_key, y_p_img, text_proxy_key, y_p_txt
    "n0": ("r1", 0.8, "r1", 0.7),
    "n1": ("r1", 0.6, "r2", 0.0),
}
CAPTION = {k: c for rows in SHARDS.values() for k, c, _ in rows}


def _write_run(root, target="sps", noisy_label=0.0) -> tuple[ViewSpec, list[str]]:
    paths = []
    for shard, rows in SHARDS.items():
        members = []
        for i, (key, caption, _) in enumerate(rows):
            members += [(f"{key}.jpg", noisy_jpeg_bytes(seed=i)), (f"{key}.txt", caption.encode())]
        paths.append(str(root / f"{shard}.tar"))
        write_tar(paths[-1], members)
        labels = pa.table(
            {
                "key": [k for k, _, _ in rows],
                "soft_label": pa.array(
                    [1.0 if s == "clean" else noisy_label for *_, s in rows], pa.float32()
                ),
                "subset": [s for *_, s in rows],
            }
        )
        (root / "labels").mkdir(exist_ok=True)
        pq.write_table(labels, root / "labels" / f"{shard}.parquet")
        noisy = [k for k, _, s in rows if s == "noisy"]
        columns = {
            "key": noisy,
            "image_proxy_key": [PROXIES[k][0] for k in noisy],
            "image_proxy_caption": [CAPTION[PROXIES[k][0]] for k in noisy],
            "y_p_img": [PROXIES[k][1] for k in noisy],
            "s_img": [0.9] * len(noisy),
            "text_proxy_key": [PROXIES[k][2] for k in noisy],
            "y_p_txt": [PROXIES[k][3] for k in noisy],
            "s_txt": [0.9] * len(noisy),
            "caption": [CAPTION[k] for k in noisy],
            "p_hat_img": [0.9] * len(noisy),
            "p_hat_txt": [0.9] * len(noisy),
        }
        (root / "proxies").mkdir(exist_ok=True)
        table = pa.table([columns[f.name] for f in SPS_PROXIES_SCHEMA], schema=SPS_PROXIES_SCHEMA)
        pq.write_table(table, root / "proxies" / f"{shard}.parquet")
    view = ViewSpec(
        name="A",
        init=ModelSpec("ncl-tiny", None, seed=0),
        seed=0,
        labels_dir=str(root / "labels"),
        target=target,
        proxies_dir=str(root / "proxies"),
    )
    return view, paths


def _rows(view, path, phase, text_proxies) -> dict[str, np.ndarray]:
    batches = list(
        read_training_batches(
            {"path": np.array([path])},
            model=view.init,
            decode=DecodeOptions(),
            view=view,
            epoch=0,
            phase=phase,
            text_proxies=text_proxies,
        )
    )
    return {name: np.concatenate([b[name] for b in batches]) for name in batches[0]}


def _find(rows, tokens) -> list[int]:
    return [i for i in range(len(rows["tokens"])) if np.array_equal(rows["tokens"][i], tokens)]


def test_both_proxy_directions_train_and_share_groups(tmp_path):
    view, paths = _write_run(tmp_path)
    pairs = text_proxy_pairs(view.labels_dir, view.proxies_dir, ("00000", "00001"))
    # The text-direction pair (r1's image, n0's caption) is attached to r1's shard; n1's is
    # below beta (y_p_txt = 0) and does not train.
    assert pairs == {"00001": [("r1", "noisy caption zero", np.float32(0.7).item(), "n0")]}
    _, tokenizer = load_transforms(view.init)
    tok = {k: tokenizer([c]).numpy()[0] for k, c in CAPTION.items()}
    noisy_phase = Phase(noisy=True, quasi_clean=True)

    home = _rows(view, paths[1], noisy_phase, pairs)
    assert len(home["weight"]) == 3  # r1, r2 and the proxy image row
    (own,) = _find(home, tok["r1"])
    (proxy,) = _find(home, tok["n0"])
    assert home["weight"][proxy] == np.float32(0.7) and home["proxy"][proxy] == 1
    assert home["reliable"][proxy] == 0 and home["reliable"][own] == 1
    np.testing.assert_array_equal(home["pixels"][proxy], home["pixels"][own])  # Ï is r1's image
    assert home["image_group"][proxy] == home["image_group"][own] == source_id("r1")
    assert home["text_group"][proxy] == source_id("n0")

    noisy_shard = _rows(view, paths[0], noisy_phase, pairs)
    swapped = _find(noisy_shard, tok["r1"])  # n0 and n1 both carry r1's caption
    assert sorted(noisy_shard["weight"][swapped].tolist()) == [np.float32(0.6), np.float32(0.8)]
    assert set(noisy_shard["text_group"][swapped]) == {source_id("r1")}
    assert len(set(noisy_shard["image_group"])) == 3

    # Before the noisy phase neither direction trains.
    early = _rows(view, paths[1], Phase(noisy=False, quasi_clean=True), pairs)
    assert len(early["weight"]) == 2 and early["proxy"].sum() == 0


def test_rematch_target_adds_both_directions_beside_the_weighted_pairs(tmp_path):
    """assign's target: every pair keeps its own row weighing its label; a noisy image with a
    rematch trains once more with the rematched caption (y_p_img), and the rematched image with
    the noisy caption (y_p_txt), from the first co-teaching epoch."""
    from pipeline.core.coteach import coteach_phase

    view, paths = _write_run(tmp_path, target="rematch", noisy_label=0.2)
    pairs = text_proxy_pairs(view.labels_dir, view.proxies_dir, ("00000", "00001"))
    _, tokenizer = load_transforms(view.init)
    tok = {k: tokenizer([c]).numpy()[0] for k, c in CAPTION.items()}
    phase = coteach_phase(0, 4, target="rematch")
    assert phase.noisy

    noisy_shard = _rows(view, paths[0], phase, pairs)
    assert len(noisy_shard["weight"]) == 5  # n0, n1, q0 and the two rematch rows
    for key, weight in (("n0", 0.2), ("n1", 0.2), ("q0", 1.0)):
        (own,) = _find(noisy_shard, tok[key])  # each pair's own row stays, weighing its label
        assert noisy_shard["weight"][own] == np.float32(weight)
        assert noisy_shard["proxy"][own] == 0 and noisy_shard["reliable"][own] == 0
        assert noisy_shard["image_group"][own] == noisy_shard["text_group"][own] == source_id(key)
    rematched = _find(noisy_shard, tok["r1"])  # n0's and n1's images with r1's caption
    assert sorted(noisy_shard["weight"][rematched].tolist()) == [np.float32(0.6), np.float32(0.8)]
    assert set(noisy_shard["proxy"][rematched]) == {1}
    assert set(noisy_shard["text_group"][rematched]) == {source_id("r1")}
    assert set(noisy_shard["image_group"][rematched]) == {source_id("n0"), source_id("n1")}
    for i in rematched:  # the added row shows the noisy pair's own image
        (own,) = [
            j
            for j in range(5)
            if noisy_shard["image_group"][j] == noisy_shard["image_group"][i]
            and not noisy_shard["proxy"][j]
        ]
        np.testing.assert_array_equal(noisy_shard["pixels"][i], noisy_shard["pixels"][own])

    home = _rows(view, paths[1], phase, pairs)
    assert len(home["weight"]) == 3  # r1, r2 and r1's image with n0's caption
    (proxy,) = _find(home, tok["n0"])
    assert home["weight"][proxy] == np.float32(0.7) and home["proxy"][proxy] == 1
    assert home["image_group"][proxy] == source_id("r1")
    assert home["text_group"][proxy] == source_id("n0")

    # The weights target reads the same tables and adds nothing.
    plain = replace(view, target="weights")
    assert len(_rows(plain, paths[0], phase, pairs)["weight"]) == 3
