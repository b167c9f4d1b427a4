"""Tests for pipeline.models.clip: loading, preflight errors, precision and checkpoints.

Only the 7M-parameter ``ncl-tiny`` config is ever built, and the Hugging Face hub is forced
offline, so the whole module runs in seconds without network access.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.io.checkpoints import save_torch_atomic
from pipeline.models import (
    LoadedClip,
    ModelLoadError,
    ModelSpec,
    check_weights_available,
    encode_pairs,
    list_builtin_configs,
    load_clip,
    resolve_device,
)
from pipeline.models import spec as spec_mod

TINY = "ncl-tiny"


@pytest.fixture(autouse=True, scope="module")
def _offline():
    # Without this, a missing tag would spend ~46 s in DNS retries before failing.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def tiny() -> LoadedClip:
    return load_clip(ModelSpec(TINY, None, seed=0), device="cpu")


def _batch(loaded: LoadedClip, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """A small real batch: solid-colour PIL images through the model's own transforms."""
    rng = np.random.default_rng(0)
    colours = rng.integers(0, 256, size=(n, 3))
    images = torch.stack(
        [loaded.preprocess(Image.new("RGB", (96, 80), tuple(int(v) for v in c))) for c in colours]
    )  # (n, 3, 64, 64)
    tokens = loaded.tokenizer([f"a photo of colour {i}" for i in range(n)])  # (n, 32)
    return images, tokens


def _weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class _Payload:
    """Would create `marker` when unpickled, if unpickling were allowed to run code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


# --------------------------------------------------------------------------------------------
# Registry and devices


def test_tiny_config_registered_once():
    assert TINY in list_builtin_configs()
    spec_mod._register_model_configs()  # a second registration must be a no-op
    from open_clip import factory

    ours = [
        p
        for p in factory._MODEL_CONFIG_PATHS
        if Path(p).resolve() == spec_mod.MODEL_CONFIG_DIR.resolve()
    ]
    assert len(ours) == 1


def test_resolve_device():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match="Unknown device"):
        resolve_device("tpu-please")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


# --------------------------------------------------------------------------------------------
# Random init


def test_random_init_is_deterministic_by_seed(tiny):
    same = load_clip(ModelSpec(TINY, None, seed=0), device="cpu")
    other = load_clip(ModelSpec(TINY, None, seed=1), device="cpu")
    assert _weights_equal(tiny.model, same.model)
    assert not _weights_equal(tiny.model, other.model)
    assert tiny.model_id == "ncl-tiny/random-seed0"
    assert other.model_id == "ncl-tiny/random-seed1"
    assert not tiny.model.training
    assert tiny.autocast_dtype is None
    assert all(p.dtype == torch.float32 for p in tiny.model.parameters())


def test_load_restores_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    load_clip(ModelSpec(TINY, None, seed=7), device="cpu")
    assert torch.equal(torch.rand(4), expected)


# --------------------------------------------------------------------------------------------
# encode_pairs


def test_encode_pairs_unit_norm_float32(tiny):
    images, tokens = _batch(tiny)
    assert images.shape == (6, 3, 64, 64) and tokens.shape == (6, 32)
    img, txt, scale = encode_pairs(tiny, images, tokens)
    assert img.shape == (6, 128) and txt.shape == (6, 128)
    assert img.dtype == torch.float32 and txt.dtype == torch.float32
    torch.testing.assert_close(img.norm(dim=-1), torch.ones(6), atol=1e-5, rtol=0)
    torch.testing.assert_close(txt.norm(dim=-1), torch.ones(6), atol=1e-5, rtol=0)
    assert isinstance(scale, float) and np.isfinite(scale) and 0 < scale <= 100
    assert scale == pytest.approx(1 / 0.07, rel=1e-5)  # CLIP's initial temperature


def test_encode_pairs_clamps_scale_and_checks_shapes(tiny):
    images, tokens = _batch(tiny, n=2)
    original = tiny.model.logit_scale.detach().clone()
    try:
        with torch.no_grad():
            tiny.model.logit_scale.fill_(10.0)  # exp(10) >> 100
        assert encode_pairs(tiny, images, tokens)[2] == 100.0
    finally:
        with torch.no_grad():
            tiny.model.logit_scale.copy_(original)
    with pytest.raises(ValueError, match="same B"):
        encode_pairs(tiny, images, tokens[:1])


# --------------------------------------------------------------------------------------------
# Local checkpoints


def test_checkpoint_roundtrip_gives_identical_outputs(tiny, tmp_path):
    ckpt = tmp_path / "nested" / "tiny.pt"
    save_torch_atomic(tiny.model.state_dict(), str(ckpt))
    assert ckpt.is_file()
    assert [p.name for p in ckpt.parent.iterdir()] == ["tiny.pt"]  # no temp file left behind

    loaded = load_clip(ModelSpec(TINY, str(ckpt), seed=99), device="cpu")
    assert _weights_equal(loaded.model, tiny.model)
    assert loaded.model_id.startswith("ncl-tiny/ckpt:") and len(loaded.model_id) == 26
    images, tokens = _batch(tiny)
    img_a, txt_a, scale_a = encode_pairs(tiny, images, tokens)
    img_b, txt_b, scale_b = encode_pairs(loaded, images, tokens)
    assert torch.equal(img_a, img_b) and torch.equal(txt_a, txt_b) and scale_a == scale_b


def test_checkpoint_wrappers_and_ddp_prefix(tiny, tmp_path):
    state = {f"module.{k}": v for k, v in tiny.model.state_dict().items()}
    for wrapper in ("state_dict", "model"):
        path = tmp_path / f"{wrapper}.pt"
        torch.save({wrapper: state, "epoch": 3}, path)
        loaded = load_clip(ModelSpec(TINY, str(path), seed=5), device="cpu")
        assert _weights_equal(loaded.model, tiny.model)


def test_checkpoint_with_pickled_object_is_refused(tiny, tmp_path):
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.pt"
    torch.save({"state_dict": tiny.model.state_dict(), "extra": _Payload(marker)}, path)
    with pytest.raises(ModelLoadError, match="weights_only=True") as err:
        load_clip(ModelSpec(TINY, str(path)), device="cpu")
    assert str(path) in str(err.value) and "open" in str(err.value)  # names the refused global
    assert not marker.exists()


def test_corrupt_checkpoint_is_a_model_load_error(tmp_path):
    path = tmp_path / "truncated.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ModelLoadError, match="could not be read"):
        load_clip(ModelSpec(TINY, str(path)), device="cpu")


def test_wrong_architecture_checkpoint_names_key_counts(tmp_path):
    import open_clip

    cfg = open_clip.get_model_config(TINY)
    cfg["vision_cfg"]["layers"] = 3  # one extra vision block -> unexpected keys
    deeper = open_clip.CLIP(**cfg)
    path = tmp_path / "deeper.pt"
    save_torch_atomic(deeper.state_dict(), str(path))
    with pytest.raises(ModelLoadError, match=r"0 missing keys .* \d+ unexpected keys"):
        load_clip(ModelSpec(TINY, str(path)), device="cpu")

    cfg = open_clip.get_model_config(TINY)
    cfg["embed_dim"] = 64  # same keys, other shapes
    narrower = open_clip.CLIP(**cfg)
    path = tmp_path / "narrower.pt"
    save_torch_atomic(narrower.state_dict(), str(path))
    with pytest.raises(ModelLoadError, match="other shapes"):
        load_clip(ModelSpec(TINY, str(path)), device="cpu")


def test_missing_checkpoint_path_is_named(tmp_path):
    path = str(tmp_path / "nope" / "model.pt")
    for call in (check_weights_available, lambda s: load_clip(s, device="cpu")):
        with pytest.raises(ModelLoadError, match="does not exist") as err:
            call(ModelSpec(TINY, path))
        assert path in str(err.value)


# --------------------------------------------------------------------------------------------
# Preflight: names and tags


def test_a_relative_checkpoint_path_is_made_absolute_for_the_workers(tmp_path, monkeypatch):
    """Ray Train workers run in a directory of their own: a job's relative checkpoint path
    must reach them as an absolute one, while a pretrained tag stays a tag."""
    from pipeline.config import load_job
    from pipeline.run.specs import with_absolute_paths

    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "teacher.pt").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: t\ninput: {shards: x.tar}\noutput: out\nmodel: {name: ncl-tiny}\n")
    job = with_absolute_paths(load_job(job_file, ["model.pretrained=w/teacher.pt"]))
    assert job.model.pretrained == str(tmp_path / "w" / "teacher.pt")
    tagged = with_absolute_paths(load_job(job_file, ["model.pretrained=openai"]))
    assert tagged.model.pretrained == "openai"


def test_model_cache_dir_reaches_every_model_the_run_loads(tmp_path, monkeypatch):
    """The embed pass (round 0's view, each round's views) and the trainers (their initial
    models) get `model.cache_dir`, made absolute for workers that run elsewhere."""
    from pipeline.config import load_job
    from pipeline.run.specs import model_specs, round_models, with_absolute_paths

    monkeypatch.chdir(tmp_path)
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: t\ninput: {shards: x.tar}\noutput: out\nmodel: {name: ncl-tiny}\n")
    job = with_absolute_paths(load_job(job_file, ["model.cache_dir=weights"]))
    specs = [*model_specs(job).values(), *round_models(job, {"A": "a.pt"}).values()]
    assert [s.cache_dir for s in specs] == [str(tmp_path / "weights")] * 3


def test_unknown_model_name_suggests_close_names():
    with pytest.raises(ModelLoadError, match="Unknown model") as err:
        check_weights_available(ModelSpec("vit-b-32", None))
    assert "'ViT-B-32'" in str(err.value)
    with pytest.raises(ModelLoadError, match="ncl-tiny"):
        load_clip(ModelSpec("ncl-tinny", None), device="cpu")


@pytest.fixture
def no_build_or_download(monkeypatch):
    """What would make a weights check slow fails the test instead: building an open_clip
    model, or asking the Hugging Face hub for a file (a spy, not a stopwatch)."""
    import huggingface_hub
    import open_clip
    from huggingface_hub import file_download

    calls = []

    class Refused(BaseException):  # not an Exception: load_clip's explaining handler passes it
        pass

    def refuse(name):
        def refused(*args, **kwargs):
            calls.append(name)
            raise Refused(f"the weights check called {name}")

        return refused

    for module, name in (
        (open_clip, "create_model_and_transforms"),
        (open_clip, "create_model"),
        (huggingface_hub, "hf_hub_download"),
        (file_download, "hf_hub_download"),
    ):
        monkeypatch.setattr(module, name, refuse(name))
    yield
    assert not calls, calls


def test_uncached_tag_offline_fails_fast_with_fix(no_build_or_download):
    from huggingface_hub import try_to_load_from_cache

    repo = "laion/CLIP-ViT-B-32-laion2B-s34B-b79K"
    for name in ("open_clip_model.safetensors", "open_clip_pytorch_model.bin"):
        if isinstance(try_to_load_from_cache(repo, name), str):
            pytest.skip("ViT-B-32 laion2b weights are cached on this machine")
    spec = ModelSpec("ViT-B-32", "laion2b_s34b_b79k", precision="bf16")
    for call in (check_weights_available, lambda s: load_clip(s, device="cpu")):
        with pytest.raises(ModelLoadError) as err:
            call(spec)
        msg = str(err.value)
        assert "laion2b_s34b_b79k" in msg and "ViT-B-32" in msg
        assert "cannot be downloaded" in msg
        assert "local checkpoint file path" in msg and "null" in msg


@pytest.mark.parametrize("filename", ["open_clip_model.safetensors", "open_clip_pytorch_model.bin"])
def test_cached_tag_passes_preflight_offline(tmp_path, monkeypatch, filename, no_build_or_download):
    # A fake Hugging Face cache in the hub layout; the preflight must find the file without
    # network access (it never builds the model, so the file's content does not matter).
    from huggingface_hub import constants

    repo = tmp_path / "models--laion--CLIP-ViT-B-32-laion2B-s34B-b79K"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / filename).write_bytes(b"weights")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    check_weights_available(ModelSpec("ViT-B-32", "laion2b_s34b_b79k"))
    check_weights_available(ModelSpec("ViT-B/32", "LAION2B-S34B-B79K"))  # open_clip spellings


def _hub_repo(cache: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """Files of a Hugging Face repo in the hub cache layout under `cache` (what
    `hf_hub_download(cache_dir=cache)` writes), for offline tests."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    return snapshot


def test_model_cache_dir_is_where_a_tag_is_looked_up(tmp_path, hub_endpoint):
    """A tag's weights in `model.cache_dir` are found there (cached); the same tag with an
    empty cache dir is to be downloaded online, and refused offline. Nothing is downloaded."""

    repo = "laion/CLIP-ViT-B-32-laion2B-s34B-b79K"
    weights = _hub_repo(tmp_path / "cache", repo, {"open_clip_model.safetensors": b"w"})
    spec = ModelSpec("ViT-B-32", "laion2b_s34b_b79k", cache_dir=str(tmp_path / "cache"))
    found = check_weights_available(spec)
    assert (found.state, found.where) == ("cached", str(weights / "open_clip_model.safetensors"))
    assert found.describe().startswith("weights cached (")

    empty = ModelSpec("ViT-B-32", "laion2b_s34b_b79k", cache_dir=str(tmp_path / "empty"))
    with pytest.raises(ModelLoadError, match="cannot be downloaded here") as offline:
        check_weights_available(empty)
    assert str(tmp_path / "empty") in str(offline.value)
    hub_endpoint(True)
    online = check_weights_available(empty)
    assert online.state == "download"
    assert online.describe() == (
        f"weights will be downloaded at run time (hf-hub {repo} (open_clip_model.safetensors or "
        f"open_clip_pytorch_model.bin) into {tmp_path / 'empty'})"
    )


def test_weights_status_of_a_local_checkpoint_and_a_random_init(tmp_path):
    path = tmp_path / "teacher.pt"
    path.write_bytes(b"")  # the preflight checks the file is there; loading reads it
    assert check_weights_available(ModelSpec(TINY, str(path))).describe() == (
        f"weights cached (local checkpoint {path})"
    )
    assert check_weights_available(ModelSpec(TINY, None)).state == "random"


def test_load_clip_reads_a_hub_model_from_model_cache_dir(tiny, tmp_path):
    """The real loading code (open_clip with huggingface_hub offline) builds an `hf-hub:` model
    from the config and weights in `cache_dir`, and cannot without it."""
    import io
    import json

    import open_clip

    state = io.BytesIO()
    torch.save(tiny.model.state_dict(), state)
    config = {"model_cfg": open_clip.get_model_config(TINY), "preprocess_cfg": {}}
    _hub_repo(
        tmp_path,
        "ncl/tiny",
        {
            "open_clip_config.json": json.dumps(config).encode(),
            "open_clip_pytorch_model.bin": state.getvalue(),
        },
    )
    spec = ModelSpec("hf-hub:ncl/tiny", None, cache_dir=str(tmp_path))
    assert check_weights_available(spec).state == "cached"
    loaded = load_clip(spec, device="cpu")
    assert _weights_equal(loaded.model, tiny.model) and loaded.model_id == "hf-hub:ncl/tiny"
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        load_clip(ModelSpec("hf-hub:ncl/tiny", None), device="cpu")


def test_unknown_tag_lists_known_tags():
    with pytest.raises(ModelLoadError, match="Unknown pretrained tag") as err:
        check_weights_available(ModelSpec("ViT-B-32", "laion2b_s34b_b79"))
    msg = str(err.value)
    assert "laion2b_s34b_b79k" in msg and "openai" in msg
    with pytest.raises(ModelLoadError, match="no pretrained tags"):
        check_weights_available(ModelSpec(TINY, "openai"))


def test_bad_precision_and_schema_with_pretrained():
    with pytest.raises(ModelLoadError, match="precision"):
        check_weights_available(ModelSpec(TINY, None, precision="int8"))
    with pytest.raises(ModelLoadError, match="must be null"):
        check_weights_available(ModelSpec("hf-hub:org/repo", "openai"))


# --------------------------------------------------------------------------------------------
# Precision


def test_fp16_on_cpu_warns_and_falls_back(tiny):
    with pytest.warns(UserWarning, match="fp16 requested on CPU"):
        loaded = load_clip(ModelSpec(TINY, None, precision="fp16"), device="cpu")
    assert loaded.autocast_dtype is None
    images, tokens = _batch(loaded)
    img, _, _ = encode_pairs(loaded, images, tokens)
    assert torch.equal(img, encode_pairs(tiny, images, tokens)[0])


def test_bf16_on_cpu_close_to_fp32(tiny):
    loaded = load_clip(ModelSpec(TINY, None, precision="bf16"), device="cpu")
    assert loaded.autocast_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())  # weights stay fp32
    images, tokens = _batch(loaded)
    img16, txt16, _ = encode_pairs(loaded, images, tokens)
    img32, txt32, _ = encode_pairs(tiny, images, tokens)
    assert img16.dtype == torch.float32 and torch.isfinite(img16).all()
    torch.testing.assert_close(img16, img32, atol=5e-2, rtol=0)
    torch.testing.assert_close(txt16, txt32, atol=5e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_cuda_matches_cpu(tiny, precision):
    from pipeline.models.encode import bf16_native

    loaded = load_clip(ModelSpec(TINY, None, precision=precision), device="cuda")
    assert loaded.device.type == "cuda"
    want = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    if precision == "bf16" and not bf16_native(loaded.device):  # T4/V100: emulated bf16
        want = None  # falls back to fp32 (is_bf16_supported() would have said yes)
    assert loaded.autocast_dtype == want
    images, tokens = _batch(loaded)
    img, txt, scale = encode_pairs(loaded, images, tokens)  # CPU inputs are moved to the GPU
    assert img.device.type == "cuda" and img.dtype == torch.float32
    ref_img, ref_txt, ref_scale = encode_pairs(tiny, images, tokens)
    atol = 1e-3 if precision == "fp32" else 5e-2
    torch.testing.assert_close(img.cpu(), ref_img, atol=atol, rtol=0)
    torch.testing.assert_close(txt.cpu(), ref_txt, atol=atol, rtol=0)
    assert scale == pytest.approx(ref_scale)


@pytest.mark.gpu
def test_cuda_checkpoint_loads_on_cpu(tmp_path):
    on_gpu = load_clip(ModelSpec(TINY, None, seed=3), device="cuda")
    path = tmp_path / "gpu.pt"
    save_torch_atomic(on_gpu.model.state_dict(), str(path))
    on_cpu = load_clip(ModelSpec(TINY, str(path)), device="cpu")
    assert _weights_equal(on_cpu.model, load_clip(ModelSpec(TINY, None, seed=3), "cpu").model)


@pytest.mark.parametrize(
    ("name", "pretrained"), [("ncl-tiny", None), ("ViT-B-32", "laion2b_s34b_b79k")]
)
def test_load_transforms_matches_the_model_transform(name, pretrained):
    """Data loaders use load_transforms; it must equal what open_clip gives with the model."""
    import open_clip
    from PIL import Image

    from pipeline.models import load_transforms

    transform, tokenizer = load_transforms(ModelSpec(name=name, pretrained=pretrained))
    _, _, reference = open_clip.create_model_and_transforms(
        name, pretrained=None, precision="fp32", device="cpu", pretrained_text=False
    )
    if pretrained:  # the tag's mean/std, as open_clip applies them when loading the tag
        from dataclasses import asdict

        from open_clip.transform import PreprocessCfg, image_transform_v2, merge_preprocess_dict

        cfg = merge_preprocess_dict(
            asdict(PreprocessCfg()), open_clip.get_pretrained_cfg(name, pretrained)
        )
        cfg["size"] = open_clip.get_model_config(name)["vision_cfg"]["image_size"]
        reference = image_transform_v2(PreprocessCfg(**cfg), is_train=False)
    image = Image.new("RGB", (97, 61), (200, 30, 90))
    torch.testing.assert_close(transform(image), reference(image))
    assert tokenizer(["a red circle"]).shape[0] == 1
