"""Node labels as configs write them (cluster/config/labels.py), their validation as one line
naming the key, and the pure parts of placement by node (cluster/runtime/pools/placement.py)."""
import pytest

from cluster.config.labels import format_labels, parse_labels
from cluster.config.ppo import ConfigError, load_config
from cluster.runtime.pools.placement import could_hold, matches, node_name, pack_target

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text, labels", [
    (None, {}),
    ("tether.pool=gen", {"tether.pool": "gen"}),
    ("tether.pool=gen, zone=a-1", {"tether.pool": "gen", "zone": "a-1"}),
    ("example.com/gpu=H100", {"example.com/gpu": "H100"}),
])
def test_parse_labels(text, labels):
    assert parse_labels(text) == labels
    if labels:
        assert parse_labels(format_labels(labels)) == labels


@pytest.mark.parametrize("text, problem", [
    ("x", "'x' has no '='"),
    ("", "'' has no '='"),
    ("=gen", "'=gen' has an empty key"),
    ("pool=", "'pool=' has an empty value"),
    ("a=1,", "'' has no '='"),
    ("a=1=2", "label value '1=2'"),
    ("a=1,a=2", "'a' is given twice"),
    ("-a=1", "label key '-a'"),
    ("-bad/a=1", "label key '-bad/a' has a bad prefix"),
    ("a=in(x)", "label value 'in(x)'"),
    ("a=" + "v" * 64, "label value"),
])
def test_malformed_labels_say_what_is_wrong(text, problem):
    with pytest.raises(ValueError) as e:
        parse_labels(text)
    assert problem in str(e.value)


@pytest.mark.parametrize("key", ["generator", "reference", "reward", "learner", "buffer"])
def test_each_section_checks_its_node_labels_in_one_line(key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}.node_labels=x"])
    assert str(e.value) == (f"config: {key}.node_labels='x': write key=value[,key=value] (as ray start --labels); "
                            "'x' has no '='")


def test_placement_keys_default_to_any_node_packed():
    cfg = load_config(None, ["generator.node_labels=tether.pool=gen", "learner.strategy=spread"])
    assert cfg.generator.node_labels == "tether.pool=gen" and cfg.learner.strategy == "spread"
    default = load_config(None)
    assert all(getattr(default, k).node_labels is None for k in ("generator", "reference", "reward", "learner",
                                                                  "buffer"))
    assert all(getattr(default, k).strategy == "pack" for k in ("generator", "reference", "reward", "learner"))
    with pytest.raises(ConfigError, match="reward.strategy='wide' is unknown; use one of pack, spread"):
        load_config(None, ["reward.strategy=wide"])


def test_stage_learner_checks_its_node_labels():
    from cluster.config.stages import SFTConfig, load_stage_config

    with pytest.raises(ConfigError, match=r"^config: learner.node_labels='a=': write key=value"):
        load_stage_config(SFTConfig, None, ["learner.node_labels=a="])


def test_node_name_and_matching():
    node_id = "9d4393fb" + "0" * 48
    labels = {"ray.io/node-id": node_id, "tether.pool": "gen", "zone": "b"}
    assert node_name(node_id, labels) == "9d4393fb[tether.pool=gen,zone=b]"
    assert node_name(node_id, {"ray.io/node-id": node_id}) == node_name(node_id) == "9d4393fb"
    node = {"NodeID": node_id, "Labels": labels, "Resources": {"CPU": 2.0}}
    assert matches(node, {}) and matches(node, {"tether.pool": "gen"}) and matches(node, {"ray.io/node-id": node_id})
    assert not matches(node, {"tether.pool": "score"}) and not matches({"Labels": {}}, {"zone": "b"})
    assert could_hold(node, {"CPU": 2.0}) and not could_hold(node, {"CPU": 1.0, "GPU": 1.0})


def test_pack_prefers_the_node_holding_the_most():
    assert pack_target([]) is None  # the first replica: Ray picks
    assert pack_target(["a", "b", "b"]) == "b"
