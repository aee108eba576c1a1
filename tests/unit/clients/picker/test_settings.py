from __future__ import annotations

import pytest

from kvindex.clients.picker.settings import PickerSettings, load_picker_settings
from kvindex.indexer.domain.errors import SettingsError


def test_layers_file_env_then_overrides() -> None:
    settings = load_picker_settings(
        {"port": 9100, "num_endpoints": 2},
        env={
            "KVINDEX_PICKER_NUM_ENDPOINTS": "4",
            "KVINDEX_PICKER_MAX_IN_FLIGHT": "8",
            "KVINDEX_PICKER_HEAD_FIRST": "false",
        },
        overrides={"port": 9200, "metrics_port": None},
    )
    assert settings == PickerSettings(port=9200, num_endpoints=4, max_in_flight=8, head_first=False)


@pytest.mark.parametrize(
    ("values", "env", "named"),
    [
        ({"port": 0}, {}, "picker.port"),
        ({"metrics_port": -2}, {}, "picker.metrics_port"),
        ({"num_endpoints": True}, {}, "picker.num_endpoints"),
        ({"lease_ttl_s": 0}, {}, "picker.lease_ttl_s"),
        ({}, {"KVINDEX_PICKER_MAX_IN_FLIGHT": "0"}, "KVINDEX_PICKER_MAX_IN_FLIGHT"),
        ({}, {"KVINDEX_PICKER_NOPE": "1"}, "KVINDEX_PICKER_NOPE"),
        ({"nope": 1}, {}, "nope"),
        ({"head_first": "yes"}, {}, "picker.head_first"),
        ({}, {"KVINDEX_PICKER_HEAD_FIRST": "maybe"}, "KVINDEX_PICKER_HEAD_FIRST"),
    ],
)
def test_a_bad_value_names_its_key(
    values: dict[str, object], env: dict[str, str], named: str
) -> None:
    with pytest.raises(SettingsError, match=named):
        load_picker_settings(values, env=env)
