"""Settings, tier policy and job state rules."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from core.settings import Settings
from core.states import FINAL_STATES, JobStatus, can_transition
from core.tiers import DEFAULT_TIER_POLICIES, Tier, engine_priority


def test_defaults_follow_the_seed_sla_levels() -> None:
    settings = Settings(_env_file=None)
    assert settings.tier_policy("premium").max_tokens == 2048
    assert settings.tier_policy("standard").timeout_s == 60
    assert settings.tier_policy(Tier.BASIC).timeout_s == 120
    assert settings.sqlalchemy_url.startswith("sqlite:///")
    assert settings.uses_local_model


def test_env_overrides_part_of_one_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERQ_TIERS", '{"basic": {"max_tokens": 64}}')
    monkeypatch.setenv("INFERQ_MAX_NUM_SEQS", "32")
    settings = Settings(_env_file=None)
    assert settings.tier_policy("basic").max_tokens == 64
    assert settings.tier_policy("basic").timeout_s == 120
    assert settings.tier_policy("premium") == DEFAULT_TIER_POLICIES[Tier.PREMIUM]
    assert settings.max_num_seqs == 32


def test_unknown_tier_name_fails_with_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERQ_TIERS", '{"gold": {"priority": 99}}')
    with pytest.raises(ValidationError, match=r"unknown tier name.*gold"):
        Settings(_env_file=None)


def test_premium_gets_the_highest_engine_priority() -> None:
    priorities = {tier: engine_priority(policy) for tier, policy in DEFAULT_TIER_POLICIES.items()}
    # vLLM runs lower numbers first.
    assert priorities[Tier.PREMIUM] < priorities[Tier.STANDARD] < priorities[Tier.BASIC]


@pytest.mark.parametrize("final", sorted(FINAL_STATES))
def test_final_states_are_final(final: JobStatus) -> None:
    assert final.is_final
    assert not any(can_transition(final, target) for target in JobStatus)


def test_a_queued_job_cannot_succeed_without_running() -> None:
    assert not can_transition(JobStatus.QUEUED, JobStatus.SUCCEEDED)
    assert can_transition(JobStatus.QUEUED, JobStatus.CANCELLED)
    assert can_transition(JobStatus.RUNNING, JobStatus.RUNNING)  # redelivery takes over


def test_a_tiers_file_is_layered_between_the_defaults_and_inferq_tiers(tmp_path: Path) -> None:
    import json

    path = tmp_path / "tiers.json"
    path.write_text(json.dumps({"basic": {"max_tokens": 100, "timeout_s": 50}}))
    settings = Settings(_env_file=None, tiers_file=path, tiers={"basic": {"max_tokens": 7}})  # type: ignore[call-arg]
    assert settings.tier_policy("basic").max_tokens == 7  # INFERQ_TIERS wins
    assert settings.tier_policy("basic").timeout_s == 50  # the file's
    assert settings.tier_policy("premium").max_tokens == 2048  # the seed's default
    path.write_text(json.dumps({"gold": {"priority": 99}}))
    with pytest.raises(ValueError, match="unknown tier name"):
        Settings(_env_file=None, tiers_file=path)  # type: ignore[call-arg]
