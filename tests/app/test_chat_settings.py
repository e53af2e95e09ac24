"""A chat's settings as one typed object: what an old chat stored reads back with defaults, a newer Pagoda's keys
are left out, and the page's values (floats from sliders, "" for no seed) come out typed."""

import pytest

from app.backend import sampling_params
from app.chat_settings import ChatSettings, as_chat_settings


def test_a_chat_saved_with_only_some_settings_gets_the_defaults_for_the_rest():
    settings = ChatSettings.from_dict({"temperature": 0.2, "max_tokens": 256, "from_a_newer_pagoda": 1})
    assert (settings.temperature, settings.max_tokens, settings.top_p, settings.think) == (0.2, 256, 0.9, True)
    assert "from_a_newer_pagoda" not in settings.to_dict()
    assert ChatSettings.from_dict(None) == ChatSettings() == as_chat_settings({})


def test_the_pages_values_come_out_typed():
    settings = ChatSettings.from_dict({"top_k": 40.0, "max_tokens": 96.0, "seed": "", "json_schema": None})
    assert settings.top_k == 40 and isinstance(settings.top_k, int) and settings.max_tokens == 96
    assert settings.seed is None and settings.json_schema == ""
    assert ChatSettings(seed=-1).seed is None and ChatSettings(seed=7.0).seed == 7
    params = sampling_params(settings.replace(temperature=0, seed=3))
    assert (params.temperature, params.top_k, params.max_tokens, params.seed) == (0.0, 40, 96, 3)


def test_a_setting_that_is_not_a_number_says_which_and_where_to_fix_it():
    with pytest.raises(ValueError, match="The chat setting temperature must be a number, got 'warm'"):
        ChatSettings(temperature="warm")
