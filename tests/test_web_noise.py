"""Tests for the web-like noise model and the teacher corpus (pipeline/data/web_noise.py), and
the guard that the ``ncr`` corpus keeps its bytes."""

from __future__ import annotations

import hashlib

import pyarrow

from pipeline.data.synthetic import make_corpus

# sha256 of a small ncr corpus as written before the web noise model existed. Parquet files
# record the writer's version ("parquet-cpp-arrow version ..."), so these hold for the pinned
# pyarrow; after a pyarrow upgrade, regenerate them from the commit that added this test.
NCR_ARGS = {
    "samples": 200,
    "samples_per_shard": 100,
    "test_samples": 50,
    "val_samples": 50,
    "corrupt": 0.02,
    "seed": 3,
}
NCR_PYARROW = "26.0.1"
NCR_DIGESTS = {
    "00000.parquet": "b1f3d8a6bae7e2069dd5339e01fa5db721990080a6ba566af2758fea2b9c28bb",
    "00000.tar": "e6e124e7172ad2f25936a1ba00f1281d780846d203601e0ba39d05832f5557cf",
    "00001.parquet": "0f36e24ff21d6275327e397fc1c7cda5dc94e7e26136fceaaf17fa851f5de90a",
    "00001.tar": "a31d4cf07f8f3b0563aa0e5185fb1f7faaf31367f78b5399c8b942fe289c161c",
    "ground_truth.parquet": "865cea2476b13b71c0ff7165777e5ba40469b69c11a87128e4d56fdff4a7d080",
    "test/00000.parquet": "fcb58cc5cf22f33da32af29ee839fd259f5434db27f67d4b23dbec5cd3df1544",
    "test/00000.tar": "3a91131f0655da35692f8b81bb5761f02cf6f02a608f01ba2f01c7e7968a51db",
    "test/ground_truth.parquet": "39e7f685c62187cb18cebd538b1756e2f7d8f3201ffdd9097933fb4fa4a671cf",
    "val/00000.parquet": "1f789e3574e1af46c299501f0abf8976ed8bc716e7f790894ade76478cb65dfc",
    "val/00000.tar": "6ce22a50f5ba1a4ed2c19d3ff9314efe767c93f71f357c15566d3a55b80a911a",
    "val/ground_truth.parquet": "88d8da15250067193914a7a6c68300659647fcd5566c582574ca0f5fdcbab181",
}


def test_ncr_corpus_bytes_unchanged(tmp_path):
    if pyarrow.__version__ != NCR_PYARROW:
        # The tars do not depend on pyarrow: check them, and skip only the Parquet digests.
        digests = {k: v for k, v in NCR_DIGESTS.items() if k.endswith(".tar")}
    else:
        digests = NCR_DIGESTS
    make_corpus(tmp_path, **NCR_ARGS)
    got = {
        str(p.relative_to(tmp_path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(tmp_path.rglob("*"))
        if p.suffix in (".tar", ".parquet")
    }
    assert {k: got[k] for k in digests} == digests
    assert set(got) == set(NCR_DIGESTS)
