"""PBSConfig parsing, JSON round trip, registry behaviour and clear errors."""

from __future__ import annotations

import json
from typing import Literal

import pytest
import torch
from pydantic import ValidationError

import pbs
from pbs.components import permuter_registry, selector_registry
from pbs.selectors.mean_pool import MeanPoolSelector


def test_defaults_are_the_quality_safe_preset():
    # The default components are the `vertical_slash_pooled` preset (docs/quality.md): no
    # permutation, the union of vertical_slash 0.75 and mean_pool 0.9; the rest as before.
    c = pbs.PBSConfig()
    assert (c.block_size, c.segment_size, c.causal, c.force_sink_block) == (128, 256, True, True)
    assert c.gqa == "shared" and c.backend == "auto" and c.version == 1 and c.check_finite is None
    assert c.dense_fallback == pbs.DenseFallback()
    assert c.permuter.name == "none" and c.selector.name == "union"
    vertical_slash = pbs.PBSConfig(selector={"name": "vertical_slash", "threshold": 0.75}).selector
    assert c.selector.selectors == (vertical_slash, MeanPoolSelector(threshold=0.9))
    assert c == pbs.PBSConfig.from_preset("vertical_slash_pooled") == pbs.PBSConfig.coerce(None)
    assert pbs.config.DEFAULT_PRESET == "vertical_slash_pooled"


def test_default_config_round_trips_through_json():
    c = pbs.PBSConfig()
    text = c.model_dump_json()
    assert pbs.PBSConfig.model_validate_json(text) == c and pbs.PBSConfig.coerce(text) == c
    # Written out in full, so a file keeps meaning this config if the defaults change again.
    data = json.loads(text)
    assert data["permuter"] == {"name": "none"}
    assert [m["name"] for m in data["selector"]["selectors"]] == ["vertical_slash", "mean_pool"]


def test_the_papers_method_stays_available_by_name():
    paper = pbs.PBSConfig.from_preset("pbs_paper")
    assert paper.permuter.name == "last_block" and paper.selector == MeanPoolSelector(threshold=0.9)
    assert paper.gqa == "per_head"
    previous_defaults = pbs.PBSConfig(permuter="last_block", selector="mean_pool")
    assert previous_defaults == paper.model_copy(update={"gqa": "shared"}) != pbs.PBSConfig()


@pytest.mark.parametrize(
    "selector",
    ["mean_pool", {"name": "mean_pool", "threshold": 0.9}, MeanPoolSelector(threshold=0.9)],
)
def test_component_given_as_name_dict_or_instance(selector):
    assert pbs.PBSConfig(selector=selector).selector == MeanPoolSelector(threshold=0.9)


@pytest.mark.parametrize("permuter", pbs.list_permuters())
@pytest.mark.parametrize("selector", pbs.list_selectors())
def test_json_round_trip(permuter, selector):
    c = pbs.PBSConfig(permuter=permuter, selector=selector, gqa="per_head", block_size=64, segment_size=512)
    text = c.model_dump_json()
    again = pbs.PBSConfig.model_validate_json(text)
    assert again == c and type(again.selector) is type(c.selector)
    assert '"version":1' in text.replace(" ", "")
    assert pbs.PBSConfig.coerce(text) == c and pbs.PBSConfig.coerce(c.model_dump()) == c


def test_unknown_name_lists_registered_names():
    with pytest.raises(ValidationError) as err:
        pbs.PBSConfig(selector="no_such_selector")
    for name in pbs.list_selectors():
        assert name in str(err.value)
    with pytest.raises(ValidationError, match="last_block"):
        pbs.PBSConfig(permuter={"name": "nope"})


def test_bad_field_names_its_path():
    with pytest.raises(ValidationError) as err:
        pbs.PBSConfig(selector={"name": "mean_pool", "threshold": 2.0})
    assert err.value.errors()[0]["loc"] == ("selector", "threshold")
    with pytest.raises(ValidationError) as err:
        pbs.PBSConfig(selector={"name": "mean_pool", "treshold": 0.5})
    assert err.value.errors()[0]["loc"] == ("selector", "treshold")
    with pytest.raises(ValidationError, match="gqa"):
        pbs.PBSConfig(gqa="replicate")
    with pytest.raises(ValidationError, match="backend"):
        pbs.PBSConfig(backend=["triton"])
    # A backend name is checked when a call is planned (a plugin may register it later):
    # tests/test_backends.py::test_unknown_backend_names_fail_when_planned_with_the_choices.


def test_unknown_field_names_the_fields_that_exist():
    # pydantic's own message is "Extra inputs are not permitted"; ours names the valid fields.
    with pytest.raises(ValidationError) as err:
        pbs.PBSConfig.model_validate({"selector": {"name": "mean_pool", "treshold": 0.9}})
    (error,) = err.value.errors()
    assert error["type"] == "extra_forbidden" and error["loc"] == ("selector", "treshold")
    assert error["msg"] == "unknown field 'treshold' of MeanPoolSelector; valid fields: name, threshold"
    with pytest.raises(ValidationError, match="unknown field 'blok_size' of PBSConfig; valid fields: .*block_size"):
        pbs.PBSConfig(blok_size=64)
    with pytest.raises(ValidationError, match="unknown field 'min_len' of DenseFallback; valid fields: min_seq_len"):
        pbs.PBSConfig(dense_fallback={"min_len": 3})
    # a nested message survives an unknown field at the top level too
    with pytest.raises(ValidationError) as err:
        pbs.PBSConfig.model_validate({"selector": {"name": "mean_pool", "treshold": 0.9}, "foo": 1})
    messages = [e["msg"] for e in err.value.errors()]
    assert messages[0].startswith("unknown field 'treshold' of MeanPoolSelector") and "'foo' of PBSConfig" in messages[1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_size=128, segment_size=320), "segment_size .* multiple of block_size"),
        (dict(block_size=96, segment_size=192), "power of two"),
        (dict(block_size=8), "block_size"),
        (dict(block_size=64, selector={"name": "antidiagonal", "stride": 48}), "stride .* must divide block_size"),
    ],
)
def test_bad_sizes(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        pbs.PBSConfig(**kwargs)


def test_config_is_frozen_and_strict():
    c = pbs.PBSConfig()
    with pytest.raises(ValidationError):
        c.block_size = 64  # type: ignore[misc]
    with pytest.raises(ValidationError, match="extra"):
        pbs.PBSConfig(blocksize=64)
    with pytest.raises(TypeError, match="config must be"):
        pbs.PBSConfig.coerce(42)  # type: ignore[arg-type]


def test_a_preset_name_is_a_config_wherever_a_config_is_taken():
    for name in pbs.config.PRESETS:
        assert pbs.PBSConfig.coerce(name) == pbs.PBSConfig.from_preset(name)
    with pytest.raises(ValueError, match=r"a JSON object or a preset name \[.*'pbs_paper'"):
        pbs.PBSConfig.coerce("pbs-paper")
    q, k, v = pbs.testing.make_qkv(batch=1, heads_q=2, heads_kv=1, seq_len=512, head_dim=16, seed=0)
    by_name, plan = pbs.attention(q, k, v, "pbs_paper", return_plan=True)
    assert plan.config == pbs.PBSConfig.from_preset("pbs_paper")
    torch.testing.assert_close(by_name, pbs.attention(q, k, v, pbs.PBSConfig.from_preset("pbs_paper")))


def test_component_registered_after_import_validates_and_runs():
    @pbs.register_selector
    class EveryOtherBlock(pbs.SelectorConfig):
        name: Literal["every_other_block"] = "every_other_block"

        def select(self, inputs):
            layout = inputs.layout
            shape = (layout.batch, layout.heads_q, layout.num_query_blocks, layout.num_key_blocks)
            return (torch.arange(layout.num_key_blocks) % 2 == 0).expand(shape).clone()

    try:
        assert "every_other_block" in pbs.list_selectors()
        config = pbs.PBSConfig.model_validate_json('{"selector": {"name": "every_other_block"}}')
        q, k, v = pbs.testing.make_qkv(seq_len=512, heads_q=2, heads_kv=1, head_dim=16)
        plan = pbs.plan(q, k, config.model_copy(update={"block_size": 64}))
        dense = plan.mask.to_dense()
        assert dense[..., 2:, 0].all()  # an even block far from the diagonal is kept
        assert not dense[0, 0, 7, 1]  # an odd off-diagonal block is not
    finally:
        selector_registry.unregister("every_other_block")
    assert "every_other_block" not in pbs.list_selectors()


def test_registering_a_different_class_under_a_taken_name_fails():
    with pytest.raises(ValueError, match="already registered"):

        @pbs.register_permuter
        class Impostor(pbs.PermuterConfig):
            name: Literal["last_block"] = "last_block"


def test_registering_needs_a_named_subclass():
    with pytest.raises(TypeError, match="subclass of PermuterConfig"):
        pbs.register_permuter(MeanPoolSelector)
    with pytest.raises(TypeError, match="default for its `name`"):

        @pbs.register_selector
        class Nameless(pbs.SelectorConfig):
            pass


def test_plugins_load_from_entry_points(monkeypatch):
    import importlib.metadata

    import pbs.registry as registry

    calls = []

    class FakeEntryPoint:
        name, value = "demo_plugin", "demo_plugin:register"

        def load(self):
            def register():
                @pbs.register_permuter
                class PluginPermuter(pbs.PermuterConfig):
                    name: Literal["plugin_identity"] = "plugin_identity"

                    def permute(self, inputs):
                        return pbs.Permutations(keys=None)

                calls.append(PluginPermuter)

            return register

    monkeypatch.setattr(registry, "_plugins_loaded", False)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [FakeEntryPoint()] if group == "pbs.plugins" else [])
    try:
        config = pbs.PBSConfig(permuter="plugin_identity")
        assert config.permuter.name == "plugin_identity" and len(calls) == 1
        assert "plugin_identity" in pbs.list_permuters() and len(calls) == 1  # loaded once
    finally:
        permuter_registry.unregister("plugin_identity")


@pytest.mark.parametrize("devices", [["cpu:0"], ["cuda", "cuda:1"], ["gpu"], [""]])
def test_dense_fallback_devices_must_be_device_types(devices):
    # The policy compares an input's device.type with these: "cpu:0" validated but never matched.
    with pytest.raises(ValidationError, match=r'dense_fallback.devices holds device types, got .*; give a device type such as "cuda" or "cpu"'):
        pbs.PBSConfig(dense_fallback={"devices": devices})


def test_dense_fallback_devices_take_any_device_type():
    assert pbs.DenseFallback(devices=["cpu", "cuda", "mps"]).devices == ("cpu", "cuda", "mps")
    assert pbs.DenseFallback(devices=[]).devices == ()


@pytest.mark.parametrize(
    "kwargs, kind",
    [
        (dict(selector={"name": ["mean_pool"]}), "selector"),
        (dict(selector={"name": {"a": 1}}), "selector"),
        (dict(selector={"name": "union", "selectors": [{"name": ["mean_pool"]}, "mean_pool"]}), "selector"),
        (dict(permuter=["last_block"]), "permuter"),
        (dict(permuter={"name": ("last_block",)}), "permuter"),
    ],
    ids=["name_list", "name_dict", "union_member", "permuter_list", "permuter_name_tuple"],
)
def test_a_name_that_is_not_a_string_lists_the_registered_names(kwargs, kind):
    # These raised "TypeError: unhashable type" (or named no choices).
    with pytest.raises(TypeError, match=rf"a {kind}.*registered {kind}s: ") as err:
        pbs.PBSConfig(**kwargs)
    names = pbs.list_selectors() if kind == "selector" else pbs.list_permuters()
    assert ", ".join(names) in str(err.value)


def _seeded_components():
    for kind, registry in (("permuter", permuter_registry), ("selector", selector_registry)):
        for name in registry.names():
            if "seed" in registry.get(name).model_fields:
                yield kind, name


@pytest.mark.parametrize("component", list(_seeded_components()), ids=lambda c: f"{c[0]}-{c[1]}")
def test_seeds_must_fit_a_torch_generator(component):
    # 2**64 validated, then failed at run time with "Overflow when unpacking long long"; a negative
    # seed would alias seed + 2**64.
    kind, name = component
    for seed in (2**64, 2**70, -1):
        with pytest.raises(ValidationError, match=r"seed must be an integer with 0 <= seed < 2\*\*64") as err:
            pbs.PBSConfig(**{kind: {"name": name, "seed": seed}})
        assert err.value.errors()[0]["loc"] == (kind, "seed")
    config = pbs.PBSConfig(block_size=32, segment_size=64, **{kind: {"name": name, "seed": 2**64 - 1}})
    q, k, _ = pbs.testing.make_qkv(seq_len=256, heads_q=2, heads_kv=1, head_dim=16)
    assert 0 < pbs.plan(q, k, config).density <= 1
    assert pbs.PBSConfig.model_validate_json(config.model_dump_json()) == config


def test_registering_a_name_outside_its_own_literal_fails():
    # pydantic does not validate defaults: such a config ran, but its JSON ({"name": "b"}) did not
    # validate as the class again.
    class Mismatched(pbs.SelectorConfig):
        name: Literal["hostile_a"] = "hostile_b"

    with pytest.raises(TypeError, match=r"""default name 'hostile_b', which its own `name` field \(Literal\['hostile_a'\]\) does not accept.*name: Literal\["hostile_b"\] = "hostile_b\""""):
        pbs.register_selector(Mismatched)
    assert "hostile_b" not in pbs.list_selectors()


def test_an_instance_of_an_unregistered_subclass_is_refused():
    # Its JSON names the parent and reads back as the parent: the selection changed after a round
    # trip (density 0.345 before, 0.982 after in one case).
    class KeepsEverything(MeanPoolSelector):
        def select(self, inputs):
            return torch.ones_like(super().select(inputs))

    mine = KeepsEverything(threshold=0.5)
    message = r"KeepsEverything is not the class registered as selector 'mean_pool'.*Register the subclass under a name of its own"
    with pytest.raises(TypeError, match=message):
        pbs.PBSConfig(selector=mine)
    with pytest.raises(TypeError, match=message):
        pbs.PBSConfig(selector={"name": "union", "selectors": [mine, "vertical_slash"]})


def test_a_subclass_registered_under_its_own_name_round_trips():
    @pbs.register_selector
    class KeepsEverything(MeanPoolSelector):
        name: Literal["hostile_keeps_everything"] = "hostile_keeps_everything"

    try:
        config = pbs.PBSConfig(selector=KeepsEverything(threshold=0.5))
        again = pbs.PBSConfig.model_validate_json(config.model_dump_json())
        assert again == config and type(again.selector) is KeepsEverything
    finally:
        selector_registry.unregister("hostile_keeps_everything")


def test_an_instance_must_carry_the_name_its_class_is_registered_under():
    @pbs.register_selector
    class FreeName(pbs.SelectorConfig):
        name: str = "hostile_free_name"

    try:
        assert pbs.PBSConfig(selector=FreeName()).selector == FreeName()
        with pytest.raises(TypeError, match=r"registered as selector 'hostile_free_name', but this instance names 'other'"):
            pbs.PBSConfig(selector=FreeName(name="other"))
    finally:
        selector_registry.unregister("hostile_free_name")
