"""Lanes: each further base model a deployment serves has tier queues of its own."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from core import keys
from core.modelinfo import ModelInfo, ServedModels
from core.settings import Settings
from core.tiers import Tier
from workers.tiny_model import build_tokenizer_json


def _settings(**values: object) -> Settings:
    return Settings(model="/models/tiny", served_model_name="tiny", **values)  # type: ignore[arg-type]


def test_the_first_models_jobs_and_its_adapters_keep_the_plain_tier_queues() -> None:
    settings = _settings(models={"smol": "/models/smol"})
    assert settings.lanes == [None, "smol"]
    assert [settings.lane_of(m) for m in (None, "tiny", "an-adapter", "smol")] == [
        None,
        None,
        None,
        "smol",
    ]
    assert keys.queue_name(Tier.PREMIUM, None) == keys.queue_name(Tier.PREMIUM) == "inferq.premium"
    assert keys.queue_name(Tier.BASIC, "smol") == "inferq.basic.model.smol"
    assert keys.held_count(Tier.BASIC, "smol") != keys.held_count(Tier.BASIC)


@pytest.mark.parametrize(
    "queue", ["inferq.basic", "inferq.basic.model.smol", "inferq.basic.model.qwen2.5-0.5b"]
)
def test_every_queue_of_a_tier_names_its_tier(queue: str) -> None:
    assert keys.tier_of_queue(queue) is Tier.BASIC


def test_a_worker_for_another_model_loads_it_under_its_name_without_adapters() -> None:
    settings = _settings(models={"smol": "/models/smol"}, lora=True)
    worker = settings.serving("smol")
    assert (worker.model_path, worker.model_name, worker.lora) == ("/models/smol", "smol", False)
    assert worker.lane_of(worker.model_name) == "smol"
    assert settings.serving("tiny") is settings
    with pytest.raises(ValueError, match="serves tiny, smol"):
        settings.serving("unknown")


def test_a_job_runs_on_its_models_tokenizer_and_an_adapter_on_the_first_models() -> None:
    tokenizer = Tokenizer.from_str(build_tokenizer_json())
    first = ModelInfo(name="tiny", max_model_len=64, tokenizer=tokenizer)
    smol = ModelInfo(name="smol", max_model_len=8192, tokenizer=tokenizer)
    models = ServedModels(first, {"smol": smol})
    assert models.names() == ["tiny", "smol"]
    assert models.of("smol") is smol
    assert models.of(None) is models.of("an-adapter") is models.of("tiny") is first
