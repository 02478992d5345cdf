"""CheckpointSettings: one validated settings object taken by every entry point."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from hf_dynaquant import CheckpointSettings, Compressor, InvalidSettingError, QuantConfig
from hf_dynaquant.search import QualityMetric
from hf_dynaquant.training.settings import ENV_PREFIX


def _model() -> torch.nn.Module:
    return torch.nn.Linear(4, 4)


@pytest.mark.parametrize(
    "bad, named",
    [
        ({"keyframe_every": 0}, "keyframe_every"),
        ({"restore_depth": 0}, "restore_depth"),
        ({"restore_depth": 2.5}, "restore_depth"),
        ({"ema_steps": 0}, "ema_steps"),
        ({"eval_examples": 0}, "eval_examples"),
        ({"checkpoint_every": 0}, "checkpoint_every"),
        ({"optimizer_state": "zip"}, "optimizer_state"),
        ({"delta_coding": "gzip"}, "delta_coding"),
        ({"threshold": -0.1}, "threshold"),
        ({"threshold": float("nan")}, "threshold"),
        ({"ema_beta": 0.0}, "ema_beta"),
    ],
)
def test_bad_values_are_refused_naming_the_setting(bad, named) -> None:
    with pytest.raises(InvalidSettingError, match=named):
        CheckpointSettings(**bad)


def test_settings_are_frozen_and_replace_validates_again() -> None:
    settings = CheckpointSettings(threshold=None)
    with pytest.raises(AttributeError):
        settings.threshold = 0.5  # type: ignore[misc]
    assert settings.replace(keyframe_every=3).keyframe_every == 3
    with pytest.raises(InvalidSettingError, match="keyframe_every"):
        settings.replace(keyframe_every=0)


def test_from_env_reads_the_accelerate_variables_and_arguments_win(monkeypatch) -> None:
    monkeypatch.setenv(ENV_PREFIX + "THRESHOLD", "none")
    monkeypatch.setenv(ENV_PREFIX + "KEYFRAME_EVERY", "4")
    monkeypatch.setenv(ENV_PREFIX + "BACKGROUND", "false")
    monkeypatch.setenv(ENV_PREFIX + "EMA_BETA", "0.5")
    monkeypatch.setenv(ENV_PREFIX + "RESTORE_DEPTH", "3")
    settings = CheckpointSettings.from_env(keyframe_every=7)
    got = (settings.threshold, settings.keyframe_every, settings.background, settings.ema_beta, settings.restore_depth)
    assert got == (None, 7, False, 0.5, 3)
    monkeypatch.setenv(ENV_PREFIX + "RESTORE_DEPTH", "off")
    assert CheckpointSettings.from_env().restore_depth is None
    monkeypatch.setenv(ENV_PREFIX + "EMA_STEPS", "many")
    with pytest.raises(InvalidSettingError, match=ENV_PREFIX + "EMA_STEPS"):
        CheckpointSettings.from_env()


def test_the_quality_metric_is_decided_in_one_place() -> None:
    assert CheckpointSettings(threshold=None).quality_metric() is None
    with pytest.raises(InvalidSettingError, match="needs eval_data"):
        CheckpointSettings().quality_metric()
    batches = [{"input": torch.randn(2, 4)}]
    assert isinstance(CheckpointSettings(eval_data=batches).quality_metric(), QualityMetric)
    callable_metric = CheckpointSettings(metric=lambda model: 1.0, higher_is_better=True).quality_metric()
    assert isinstance(callable_metric, QualityMetric) and callable_metric.higher_is_better
    default = QualityMetric(lambda model: 0.0)
    assert CheckpointSettings().quality_metric(default) is default  # an integration's own default


def test_compressor_takes_settings_or_shortcuts_not_both(tmp_path) -> None:
    settings = CheckpointSettings(threshold=None, config=QuantConfig(bins=8), keyframe_every=3)
    compressor = Compressor(_model(), tmp_path / "a", settings=settings)
    assert compressor.settings is settings and compressor.config.bins == 8 and compressor.search is None
    shortcut = Compressor(_model(), tmp_path / "b", QuantConfig(bins=8), keyframe_every=3)
    assert shortcut.settings == settings  # the plain API keeps a fixed configuration without a threshold
    with pytest.raises(InvalidSettingError, match="not both"):
        Compressor(_model(), tmp_path / "c", settings=settings, keyframe_every=4)
    with pytest.raises(InvalidSettingError, match="needs eval_data"):
        Compressor(_model(), tmp_path / "d", threshold=0.01)


def test_callback_and_plugin_take_the_same_settings() -> None:
    from hf_dynaquant import DynaQuantCallback, DynaQuantPlugin

    settings = CheckpointSettings(threshold=None, keyframe_every=5, optimizer_state="lossless")
    callback, plugin = DynaQuantCallback(settings=settings), DynaQuantPlugin(settings=settings)
    assert callback.settings is settings and plugin.settings is settings
    assert (callback.keyframe_every, plugin.optimizer_state) == (5, "lossless")  # fields read through
    assert DynaQuantCallback(None, keyframe_every=5, optimizer_state="lossless").settings == settings
    with pytest.raises(InvalidSettingError, match="not both"):
        DynaQuantCallback(0.02, settings=settings)
    with pytest.raises(InvalidSettingError, match="store_dir"):
        DynaQuantCallback(store_dir="elsewhere")  # the Trainer's store sits beside its folders


def test_describe_lists_every_setting() -> None:
    text = CheckpointSettings.describe()
    for f in fields(CheckpointSettings):
        assert f"{f.name} = " in text and f.metadata["help"]


def test_codec_setting_names_a_weights_codec_and_which_peers_search() -> None:
    from hf_dynaquant import CheckpointSettings
    from hf_dynaquant.errors import InvalidSettingError

    assert CheckpointSettings().codec == "dynaquant"
    assert CheckpointSettings(codec="nf4", threshold=None).codec == "nf4"
    with pytest.raises(InvalidSettingError, match="codec='nf4' takes threshold=None: it has no configuration"):
        CheckpointSettings(codec="nf4", threshold=0.01)
    assert CheckpointSettings(codec="qd", threshold=0.01).threshold == 0.01  # its bits searched (search.peers)
    assert CheckpointSettings(codec="excp", threshold=None).codec == "excp"  # weights and moments together
    with pytest.raises(InvalidSettingError, match="leave optimizer_state='compress'"):
        CheckpointSettings(codec="excp", threshold=None, optimizer_state="lossless")
    with pytest.raises(InvalidSettingError, match="codec must be one of"):
        CheckpointSettings(codec="zip", threshold=None)
