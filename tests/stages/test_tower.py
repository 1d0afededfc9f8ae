"""Vision towers: batching against transformers' own modules, the sim tower against an
independent re-implementation of its row formula, failures, row counts, and the
registry the configuration reads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from stages.towers import (
    TOWER_SETTINGS,
    TOWERS,
    Tower,
    TowerError,
    TowerInputError,
    TowerItem,
    TowerSpec,
    build_tower,
)
from stages.towers.sim import sim_rows

NP = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def to_np(t: torch.Tensor, dtype: str) -> np.ndarray:
    t = t.detach().to("cpu", TORCH[dtype]).contiguous()
    return t.view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else t.numpy()


def from_np(a: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if a.dtype == np.uint16 else t


def make_pixels(seed: int, grid, patch_dim: int, dtype: str = "float32") -> np.ndarray:
    n = sum(t * h * w for t, h, w in grid)
    g = torch.Generator().manual_seed(seed)
    return to_np(torch.randn(n, patch_dim, generator=g), dtype)


def make_outs(tower: Tower, items, fill: int = 0x55):
    """Outs as views into one flat 'arena' buffer, like shared memory."""
    spec = tower.spec
    spans = [tower.span(it.grid_thw) for it in items]
    width = spec.hidden + spec.deepstack_width
    arena = np.full(sum(spans) * width * np.dtype(NP[spec.dtype]).itemsize, fill, np.uint8)
    flat = arena.view(NP[spec.dtype])
    outs, pos = [], 0
    for s in spans:
        main = flat[pos:pos + s * spec.hidden].reshape(s, spec.hidden)
        pos += s * spec.hidden
        deep = None
        if spec.deepstack_width:
            deep = flat[pos:pos + s * spec.deepstack_width].reshape(s, spec.deepstack_width)
            pos += s * spec.deepstack_width
        outs.append((main, deep))
    return outs


def run(tower: Tower, items, outs=None):
    outs = make_outs(tower, items) if outs is None else outs
    tower.start(items, outs).result()
    return outs


# ----------------------------------------------------------------------------- torch towers

# Images of different grids, two videos (t=2), and one item of two grids; interleaved
# so grouping per modality must put rows back in the right places.
GRIDS = [
    ("image", [(1, 4, 6)]),
    ("video", [(2, 4, 4)]),
    ("image", [(1, 8, 8)]),  # several attention windows in the tiny qwen2.5 config
    ("image", [(1, 2, 2)]),
    ("video", [(2, 6, 4)]),
    ("image", [(1, 4, 4), (1, 2, 6)]),
]


@pytest.fixture(scope="module", params=["qwen2.5-vl", "qwen3-vl"])
def qwen(request):
    # float32 on every device (on CUDA the default would be bfloat16)
    return build_tower(request.param, config="tiny", dtype="float32")


def hf_alone(tower, item):
    """What transformers' own module gives for this item on its own."""
    device = next(tower.model.parameters()).device
    with torch.inference_mode():
        out = tower.model(
            hidden_states=from_np(item.pixels).to(device=device, dtype=tower.model.dtype),
            grid_thw=torch.tensor(item.grid_thw, dtype=torch.long, device=device),
        )
    deep = None
    if getattr(out, "deepstack_features", None):
        deep = torch.cat(list(out.deepstack_features), dim=1).cpu()
    return out.pooler_output.cpu(), deep


def test_tiny_specs(qwen):
    spec = qwen.spec
    assert spec.name in ("qwen2.5-vl", "qwen3-vl")
    assert (spec.hidden, spec.dtype, spec.merge, spec.patch, spec.temporal_patch) == (128, "float32", 2, 14, 2)
    assert spec.patch_dim == 3 * 2 * 14 * 14 == 1176
    assert spec.deepstack_width == (2 * 128 if spec.name == "qwen3-vl" else 0)
    assert spec.hidden == qwen.model.config.out_hidden_size


def test_batch_matches_module_alone(qwen):
    spec = qwen.spec
    items = [TowerItem(m, g, make_pixels(i, g, spec.patch_dim)) for i, (m, g) in enumerate(GRIDS)]
    outs = run(qwen, items)
    # On CUDA, cuDNN's convolutions run in TF32 and pick algorithms by shape.
    tol = dict(rtol=2e-3, atol=5e-4) if torch.cuda.is_available() else dict(rtol=1e-4, atol=1e-5)
    for item, (main, deep) in zip(items, outs):
        ref_main, ref_deep = hf_alone(qwen, item)
        assert main.shape == (qwen.span(item.grid_thw), spec.hidden) == tuple(ref_main.shape)
        np.testing.assert_allclose(main, ref_main.numpy(), **tol)
        if spec.deepstack_width:
            assert ref_deep.shape == (main.shape[0], spec.deepstack_width)
            np.testing.assert_allclose(deep, ref_deep.numpy(), **tol)
        else:
            assert deep is None and ref_deep is None
    # items really differ (a mix-up of rows would not go unnoticed)
    assert not np.allclose(outs[0][0][:1], outs[2][0][:1])


@pytest.mark.parametrize("name", ["qwen2.5-vl", "qwen3-vl"])
def test_bfloat16_tower_mixed_pixel_dtypes(name):
    tower = build_tower(name, config="tiny", dtype="bfloat16")
    spec = tower.spec
    assert spec.dtype == "bfloat16"
    dtypes = ["bfloat16", "float16", "float32", "bfloat16"]
    items = [TowerItem(m, g, make_pixels(10 + i, g, spec.patch_dim, dtypes[i]))
             for i, (m, g) in enumerate(GRIDS[:4])]
    outs = run(tower, items)
    for item, (main, deep) in zip(items, outs):
        assert main.dtype == np.uint16
        ref_main, ref_deep = hf_alone(tower, item)
        got = from_np(main).float()
        # bfloat16: within about one ulp (identical on CPU)
        torch.testing.assert_close(got, ref_main.float(), rtol=1.6e-2, atol=2e-3)
        if spec.deepstack_width:
            torch.testing.assert_close(from_np(deep).float(), ref_deep.float(), rtol=1.6e-2, atol=2e-3)


@pytest.mark.parametrize("name,prefix", [("qwen2.5-vl", "visual."), ("qwen3-vl", "model.visual.")])
def test_checkpoint_loads_vision_weights_only(tmp_path, name, prefix):
    from safetensors.torch import save_file

    src = build_tower(name, config="tiny", seed=1)
    vision = src.model.config.to_dict()
    model_type = {"qwen2.5-vl": "qwen2_5_vl", "qwen3-vl": "qwen3_vl"}[name]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "vision_config": vision}))
    state = {prefix + k: v.contiguous() for k, v in src.model.state_dict().items()}
    save_file(dict(list(state.items())[: len(state) // 2]), tmp_path / "model-00001-of-00002.safetensors")
    rest = dict(list(state.items())[len(state) // 2:])
    rest["lm_head.weight"] = torch.zeros(4, 4)  # not the tower's: ignored
    save_file(rest, tmp_path / "model-00002-of-00002.safetensors")

    tower = build_tower(name, checkpoint=str(tmp_path))
    assert tower.spec == src.spec
    items = [TowerItem(m, g, make_pixels(i, g, src.spec.patch_dim)) for i, (m, g) in enumerate(GRIDS[:3])]
    for (a, da), (b, db) in zip(run(src, items), run(tower, items)):
        np.testing.assert_array_equal(a, b)
        if da is not None:
            np.testing.assert_array_equal(da, db)


def test_forward_that_raises_is_tower_error(qwen, monkeypatch):
    def boom(pixels, grid):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(qwen, "forward", boom)
    items = [TowerItem("image", [(1, 4, 4)], make_pixels(0, [(1, 4, 4)], qwen.spec.patch_dim))]
    with pytest.raises(TowerError, match="device fell over"):
        run(qwen, items)


@pytest.mark.parametrize("half", ["main", "deepstack"])
def test_wrong_row_count_is_tower_error(qwen, monkeypatch, half):
    if half == "deepstack" and not qwen.spec.deepstack_width:
        pytest.skip("no deepstack")
    original = qwen.forward

    def short(pixels, grid):
        main, deep = original(pixels, grid)
        return (main[:-1], deep) if half == "main" else (main, deep[:-1])

    monkeypatch.setattr(qwen, "forward", short)
    g = [(1, 4, 6)]
    items = [TowerItem("image", g, make_pixels(0, g, qwen.spec.patch_dim))] * 2
    with pytest.raises(TowerError, match=r"expected 12 rows.*got shape \(11,"):
        run(qwen, items)


@pytest.mark.skipif(torch.cuda.is_available(), reason=(
    "seen on an H200: a merger patched to drop a row leaves the CUDA context broken and the "
    "process aborts at its next garbage collection; the row check itself is covered by "
    "test_wrong_row_count_is_tower_error"))
def test_hf_module_row_count_wrong_is_tower_error(qwen, monkeypatch):
    """The HF merger itself returning a row too few (not just our wrapper)."""
    merger = qwen.model.merger
    original = merger.forward
    monkeypatch.setattr(merger, "forward", lambda x: original(x)[:-1])
    with pytest.raises(TowerError):
        run(qwen, [TowerItem("video", [(2, 4, 4)], make_pixels(0, [(2, 4, 4)], qwen.spec.patch_dim))])


# ----------------------------------------------------------------------------- sim: independent model

# The documented formula, re-implemented here (constants pinned on purpose).
SEED, PERIOD, LEN = 0x5EED7043, 1_000_003, 1_000_003 + 2**22


@pytest.fixture(scope="module")
def f32_pattern():
    return np.random.default_rng(SEED).standard_normal(LEN, dtype=np.float32)


def expected_rows(f32, dtype, pixels: np.ndarray, modality, span, hidden, deep_width):
    if dtype == "float32":
        pat = f32
    elif dtype == "float16":
        pat = f32.astype(np.float16)
    else:
        pat = (f32.view(np.uint32) >> 16).astype(np.uint16)
    h = xxhash.xxh3_64_intdigest(pixels.tobytes(), seed={"image": 0, "video": 1}[modality])

    def take(off, n):
        return pat[(off + np.arange(n)) % LEN]

    main = take(h % PERIOD, span * hidden).reshape(span, hidden)
    deep = take((h // PERIOD) % PERIOD, span * deep_width).reshape(span, deep_width) if deep_width else None
    return main, deep


@pytest.mark.parametrize(
    "dtype,hidden,deep_width",
    [("bfloat16", 3584, 0), ("float32", 64, 48), ("float16", 100, 0), ("bfloat16", 96, 192)],
)
def test_sim_rows_match_independent_formula(f32_pattern, dtype, hidden, deep_width):
    tower = build_tower("sim", hidden=hidden, deepstack_width=deep_width, dtype=dtype, time_per_row_s=0)
    spec = tower.spec
    assert (spec.hidden, spec.deepstack_width, spec.dtype, spec.patch_dim) == (hidden, deep_width, dtype, 1176)
    items = [TowerItem(m, g, make_pixels(i, g, spec.patch_dim, ["float32", "bfloat16", "float16"][i % 3]))
             for i, (m, g) in enumerate(GRIDS)]
    outs = run(tower, items)
    for item, (main, deep) in zip(items, outs):
        span = tower.span(item.grid_thw)
        want_main, want_deep = expected_rows(f32_pattern, dtype, item.pixels, item.modality, span, hidden, deep_width)
        assert main.dtype == NP[dtype] and main.shape == (span, hidden)
        np.testing.assert_array_equal(main, want_main)
        pure = sim_rows(spec, item.pixels.tobytes(), item.modality, span)
        np.testing.assert_array_equal(pure[0], want_main)
        if deep_width:
            assert deep.shape == (span, deep_width)
            np.testing.assert_array_equal(deep, want_deep)
            np.testing.assert_array_equal(pure[1], want_deep)
            assert not np.array_equal(deep[:, :32], main[:, :32])
        else:
            assert deep is None and pure[1] is None


def test_sim_item_longer_than_pattern_wraps(f32_pattern):
    tower = build_tower("sim", hidden=3584, patch=2, time_per_row_s=0)  # patch_dim 24
    g = [(1, 60, 100)]  # 1500 rows * 3584 > SIM_PATTERN_LEN: wraps for any offset
    item = TowerItem("image", g, make_pixels(3, g, tower.spec.patch_dim))
    (main, _), = run(tower, [item])
    want, _ = expected_rows(f32_pattern, "bfloat16", item.pixels, "image", 1500, 3584, 0)
    np.testing.assert_array_equal(main, want)


def test_sim_rows_depend_on_pixels_and_modality():
    tower = build_tower("sim", hidden=64, deepstack_width=64, time_per_row_s=0)
    g = [(1, 4, 4)]
    a = make_pixels(1, g, tower.spec.patch_dim, "bfloat16")
    b = a.copy()
    b[3, 7] ^= 1  # one bit
    outs = run(tower, [TowerItem("image", g, a), TowerItem("image", g, b),
                       TowerItem("video", g, a), TowerItem("image", g, a.copy())])
    (ma, da), (mb, db), (mv, dv), (ma2, da2) = outs
    assert not np.array_equal(ma, mb) and not np.array_equal(da, db)
    assert not np.array_equal(ma, mv)
    np.testing.assert_array_equal(ma, ma2)
    np.testing.assert_array_equal(da, da2)


def test_sim_async_waits_and_serialises_jobs():
    tpr = 2e-3
    tower = build_tower("sim", hidden=16, time_per_row_s=tpr)
    g = [(1, 16, 16)]  # 64 rows -> 0.128 s of device time
    items = [TowerItem("image", g, make_pixels(0, g, tower.spec.patch_dim))]
    j1 = tower.start(items, make_outs(tower, items))
    j2 = tower.start(items * 2, make_outs(tower, items * 2))
    assert not j1.done() and not j2.done()
    # the second batch starts when the first ends
    assert j2.ready_at == pytest.approx(j1.ready_at + 128 * tpr, abs=1e-9)
    assert tower.device_free_at == j2.ready_at
    with pytest.raises(TimeoutError):
        j2.result(timeout=0)
    j1.result()
    assert j1.done() and time.monotonic() >= j1.ready_at
    j2.result()
    assert j2.done() and time.monotonic() >= j2.ready_at
    # an idle device starts the next batch now, not at the old device_free_at
    j3 = tower.start(items, make_outs(tower, items))
    assert j3.ready_at > j2.ready_at + 64 * tpr - 1e-9
    j3.result()


def test_sim_injected_failure():
    tower = build_tower("sim", hidden=16, time_per_row_s=0)
    g = [(1, 2, 2)]
    items = [TowerItem("image", g, make_pixels(0, g, tower.spec.patch_dim))]
    tower.fail_next = 1
    with pytest.raises(TowerError):
        run(tower, items)
    run(tower, items)  # the next batch is fine


# ----------------------------------------------------------------------------- validation, spans


def test_bad_outs_and_items_are_input_errors():
    tower = build_tower("sim", hidden=16, dtype="float16", time_per_row_s=0)
    g = [(1, 4, 4)]
    px = make_pixels(0, g, tower.spec.patch_dim)
    item = TowerItem("image", g, px)
    bad = [
        ([item], [(np.empty((4, 16), np.float32), None)]),  # dtype
        ([item], [(np.empty((5, 16), np.float16), None)]),  # rows
        ([item], [(np.empty((4, 16), np.float16), np.empty((4, 4), np.float16))]),  # no deepstack
        ([item], []),
        ([TowerItem("audio", g, px)], [(np.empty((4, 16), np.float16), None)]),
        ([TowerItem("image", [(1, 4, 2)], px)], [(np.empty((2, 16), np.float16), None)]),  # shape
        ([TowerItem("image", g, px.astype(np.float64))], [(np.empty((4, 16), np.float16), None)]),
        ([TowerItem("image", [(1, 3, 4)], px[:12])], [(np.empty((3, 16), np.float16), None)]),
    ]
    for items, outs in bad:
        with pytest.raises(TowerInputError):
            tower.start(items, outs)
    assert issubclass(TowerInputError, TowerError) and issubclass(TowerInputError, ValueError)


def check_spans(t: Tower):
    assert t.span([(1, 2, 2)]) == 1
    assert t.span([(3, 2, 2)]) == 3  # odd t is fine
    assert t.span([(1, 6, 10)]) == 15  # odd merged grid
    assert t.span([(2, 4, 6)]) == 12
    assert t.span([(1, 4, 4), (1, 2, 6)]) == 4 + 3
    assert t.span((1, 4, 4)) == 4  # a single flat triple
    for bad in ([(1, 3, 4)], [(1, 4, 5)], [(2, 7, 7)], [(1, 4, 4), (1, 2, 3)], [], [(0, 2, 2)],
                [(1, 2)], [(1.5, 2, 2)]):
        with pytest.raises(ValueError):
            t.span(bad)


def test_span_row_counts_sim():
    check_spans(build_tower("sim"))


def test_span_row_counts_qwen(qwen):
    check_spans(qwen)


@given(st.lists(st.tuples(st.integers(1, 8), st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=4),
       st.sampled_from([1, 2, 4]))
def test_span_property(grid, merge):
    t = build_tower("sim", merge=merge, hidden=8, time_per_row_s=0)
    if all(h % merge == 0 and w % merge == 0 for _, h, w in grid):
        assert t.span(grid) == sum(a * b * c for a, b, c in grid) // merge**2
        assert t.span(grid) * merge**2 == sum(a * b * c for a, b, c in grid)
    else:
        with pytest.raises(ValueError):
            t.span(grid)


def test_spec_and_factory_validation():
    with pytest.raises(ValueError):
        build_tower("nope")
    with pytest.raises(ValueError):
        build_tower("sim", dtype="float64")
    with pytest.raises(ValueError):
        TowerSpec("x", 0, 0, "float32", 2, 1176, 2, 14)
    with pytest.raises(ValueError):
        build_tower("qwen3-vl")  # neither config nor checkpoint


# ----------------------------------------------------------------------------- registry, settings


def test_every_tower_setting_is_a_config_key():
    from pipeline.cli.config import FIELDS

    for tower in TOWERS.values():
        for s in tower.settings:
            assert TOWER_SETTINGS[s.key] == s, f"{tower.__name__} and another tower declare {s.key} apart"
            f = FIELDS[s.key]
            assert (f.default, f.type, f.metadata["help"]) == (s.default, type(s.default).__name__, s.help)


def test_config_defaults_build_the_sim_towers_defaults():
    from pipeline.cli.config import WorkerConfig

    assert build_tower("sim", **WorkerConfig(tower="sim").tower_settings()).spec == build_tower("sim").spec


def test_the_sim_tower_is_configured_by_its_settings_file(tmp_path):
    """--tower sim: tower_config names its settings file (its checkpoint); its knobs are no
    flags or EPD_ variables of the worker's."""
    from pipeline.cli.config import FIELDS, ConfigError, WorkerConfig, load_config
    from pipeline.testing.workers import with_sim_tower

    given = with_sim_tower(tmp_path, dict(tower="sim", sim_hidden=64, sim_dtype="float16", sim_fail_batches=2))
    tower = build_tower("sim", **WorkerConfig(**given).tower_settings())
    assert (tower.spec.hidden, tower.spec.dtype, tower.fail_next) == (64, "float16", 2)
    toml = tmp_path / "sim.toml"
    toml.write_text('hidden = 32\ntime_per_row_s = 0\n[faults]\nload_s = 0\n')
    assert WorkerConfig(tower="sim", tower_config=str(toml)).tower_settings() == dict(
        hidden=32, time_per_row_s=0.0, load_s=0.0)
    assert not [key for key in FIELDS if key.startswith("sim_")]
    with pytest.raises(ConfigError, match="EPD_SIM_HIDDEN: no such setting"):
        load_config(environ={"EPD_SIM_HIDDEN": "64"})
    for text, problem in [("hiden = 3", "unknown setting 'hiden'"), ("hidden = 0", "hidden must be >= 1"),
                          ('dtype = "int8"', "dtype must be one of"), ("hidden = 1.5", "hidden must be int"),
                          ("[faults]\nfail_batches = -1", "fail_batches must be >= 0"), ("hidden =", "not valid TOML")]:
        toml.write_text(text + "\n")
        with pytest.raises(ConfigError) as e:
            WorkerConfig(tower="sim", tower_config=str(toml)).resolved().validate()
        assert e.value.key == "tower_config" and problem in str(e.value) and str(toml) in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="cannot read it"):
        WorkerConfig(tower="sim", tower_config=str(tmp_path / "none.toml")).resolved().validate()


def test_qwen_tower_settings(tmp_path):
    from pipeline.cli.config import WorkerConfig

    cfg = WorkerConfig(tower="qwen3-vl", gpu=1)
    assert cfg.tower_settings() == {"config": "tiny", "gpu": 1}
    cfg = WorkerConfig(tower="qwen2.5-vl", tower_config=str(tmp_path), tower_dtype="float16")
    assert cfg.tower_settings() == {"checkpoint": str(tmp_path), "dtype": "float16", "gpu": 0}


def test_only_the_tower_process_imports_torch():
    """The registry, the configuration, the tower stage and a sim tower leave torch unloaded:
    only a qwen tower, built in the tower process, loads it."""
    code = ("import sys\n"
            "import pipeline.cli.config, stages.tower\n"
            "from stages.towers import build_tower\n"
            "build_tower('sim', **pipeline.cli.config.WorkerConfig(tower='sim').tower_settings())\n"
            "print(sorted({'torch', 'transformers', 'safetensors'} & set(sys.modules)))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"
