"""What clients call the model, and the engine's dtype on a CPU without native bf16."""

from __future__ import annotations

from pathlib import Path

from core.modelinfo import ModelManifest, served_model_name
from core.settings import Settings
from workers.devices import cpu_has_native_bf16
from workers.engine import engine_args


def test_the_served_name_is_never_a_path(tmp_path: Path) -> None:
    model = tmp_path / "my-model"
    model.mkdir()
    assert served_model_name(str(model)) == "my-model"
    ModelManifest("smollm2-135m-instruct", "demo", "a file", "0" * 64).write(model)
    assert served_model_name(str(model)) == "smollm2-135m-instruct"
    assert served_model_name(str(model), "prod-chat") == "prod-chat"
    assert served_model_name("org/Some-Model-7B") == "org/Some-Model-7B"
    assert Settings(model=str(model), served_model_name="x").model_name == "x"


def test_a_manifest_that_is_not_ours_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "inferq-model.json").write_text('{"something": "else"}')
    assert ModelManifest.read(tmp_path) is None
    assert ModelManifest.read(tmp_path / "missing") is None


AVX2_HOST = "processor : 0\nflags : fpu sse2 avx avx2 fma\n"
BF16_HOST = "processor : 0\nflags : fpu avx2 avx512f avx512_bf16 amx_tile\n"


def test_native_bf16_is_read_from_the_cpu_flags() -> None:
    assert not cpu_has_native_bf16(AVX2_HOST)
    assert cpu_has_native_bf16(BF16_HOST)
    assert not cpu_has_native_bf16("")


def test_auto_dtype_on_a_cpu_follows_its_bf16_support(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import workers.engine

    settings = Settings(model="/models/m")
    for cpuinfo, dtype in ((AVX2_HOST, "float32"), (BF16_HOST, "auto")):
        monkeypatch.setattr(
            workers.engine, "cpu_has_native_bf16", lambda i=cpuinfo: cpu_has_native_bf16(i)
        )
        assert engine_args(settings, device="cpu", num_gpus=0)["dtype"] == dtype
    assert engine_args(settings, device="cuda", num_gpus=1)["dtype"] == "auto"
    assert (
        engine_args(Settings(model="/m", dtype="bfloat16"), device="cpu", num_gpus=0)["dtype"]
        == "bfloat16"
    )
