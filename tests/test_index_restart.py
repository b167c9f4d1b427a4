"""Index actors survive a restart: a restarted actor rebuilds the same index from its restore
table (rows, stored fields, IVF codebooks), so a label pass continues after a lost node."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.config import IndexConfig
from pipeline.core.search.neighbours import IndexStore
from pipeline.stages.labels import LabelSpec
from pipeline.stages.labels.index_actors import (
    IndexStoreActor,
    actor_neighbours,
    build_index_actors,
    remove_restore_tables,
    report_restarts,
    train_task,
)

DIM = 16


def _parts(n: int, stores: int, seed: int = 0) -> list[dict]:
    """Rows split by owner (id % stores), with every stored field."""
    rng = np.random.default_rng(seed)
    u = rng.standard_normal((n, DIM)).astype(np.float32)
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    ids = np.arange(n, dtype=np.int64) * 3 + 1  # not 0..n-1: the ids must survive as stored
    rows = {
        "ids": ids,
        "u": u,
        "v": v,
        "keys": np.asarray([f"k{i:04d}" for i in ids], dtype=object),
        "captions": np.asarray([f"a caption {i}" for i in ids], dtype=object),
        "groups": ids // 2,
    }
    return [{k: x[ids % stores == s] for k, x in rows.items()} for s in range(stores)]


@pytest.mark.parametrize("factory", ["Flat", "IVF4,Flat"])
def test_a_restarted_store_is_the_same_index(factory, tmp_path):
    part = _parts(200, 1)[0]
    trained = [
        None if factory == "Flat" else train_task(DIM, factory, 4, 0, modality, part)
        for modality in ("image", "text")
    ]
    restore = str(tmp_path / "store_000.parquet")
    first = IndexStoreActor(DIM, factory, 4, 0, restore)
    assert first.load(*trained, part) == 200
    again = IndexStoreActor(DIM, factory, 4, 0, restore)  # what Ray's restart runs
    assert again.rows() == 200
    assert again.load(*trained, part) == 200  # Ray's retry of load: nothing added twice
    queries = _parts(20, 1, seed=1)[0]["u"]
    for modality in ("image", "text"):
        want, got = first.search(modality, queries, 5), again.search(modality, queries, 5)
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got[0], want[0])
    ids = part["ids"][::7]
    fields = ("u", "v", "keys", "captions", "groups")
    want, got = first.lookup(ids, fields), again.lookup(ids, fields)
    for name in fields:
        np.testing.assert_array_equal(got[name], want[name])
    # The store rebuilt from the table equals one built from the rows directly.
    plain = IndexStore(DIM, factory, 4, 0)
    plain.add(part)
    plain.build(None if factory == "Flat" else {**trained[0], **trained[1]})
    np.testing.assert_array_equal(
        plain.search("text", queries, 5)[1], again.search("text", queries, 5)[1]
    )


@pytest.mark.ray
def test_a_killed_index_actor_restarts_with_its_index(local_ray, tmp_path, caplog):
    ray = local_ray
    spec = LabelSpec(
        str(tmp_path), 1, "a", ("x",), str(tmp_path / "labels"), index=IndexConfig(shards=2)
    )
    parts = _parts(300, 2)
    actors, sizes = build_index_actors(spec, [[ray.put(p) for p in parts]], DIM)
    try:
        assert sizes == [150, 150]
        # Alive index actors hold no CPU: the label tasks that query them need every one
        # (an actor holding a CPU each hung the label pass on a 2-CPU node).
        assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]
        search = actor_neighbours(actors)
        queries = _parts(30, 1, seed=2)[0]["v"]
        before = search.search("image", queries, 10)
        ray.kill(actors[0], no_restart=False)  # as if its node died: Ray restarts it
        after = search.search("image", queries, 10)
        np.testing.assert_array_equal(after[1], before[1])
        np.testing.assert_array_equal(after[0], before[0])
        looked_up = search.lookup(parts[0]["ids"][:5], ("keys",))
        assert list(looked_up["keys"]) == list(parts[0]["keys"][:5])
        # The driver says so (the actor's own warning stays in Ray's worker log).
        with caplog.at_level("WARNING", logger="pipeline"):
            report_restarts(actors)
        said = [r.getMessage() for r in caplog.records if "index actor restarted" in r.getMessage()]
        assert len(said) == 1 and "rebuilt 150 rows from" in said[0], said
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_restore_tables(spec)
    assert not (tmp_path / "rounds/1/index_a/_restore").exists()
