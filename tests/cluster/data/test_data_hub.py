"""data.path as a Hugging Face Hub dataset id, read by the real `datasets.load_dataset` from a real
local datasets cache with the Hub out of reach (tests/hub_cache.py makes the cache)."""
import pytest
from hub_cache import cache_hub_dataset

from cluster.data.hub import is_hub_id, read_hub_rows
from cluster.data.prompts import PromptDataset, read_records
from cluster.demo.tiny_models import build_tokenizer

pytestmark = pytest.mark.unit
datasets = pytest.importorskip("datasets")

MAIN = {"train": {"question": ["The cat was", "A dog felt", "  "], "answer": ["1", "2", "3"]},
        "test": {"question": ["My friend felt"], "answer": ["4"]}}
SOCRATIC = {"train": {"question": ["Why is the sky", "How does rain"], "answer": ["5", "6"]}}


@pytest.fixture(scope="module")
def tok_path():
    return str(build_tokenizer())


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """datasets' cache in tmp_path, the Hub unreachable (HF_HUB_OFFLINE=1, as datasets reads it)."""
    cache = tmp_path / "hf" / "datasets"
    cache.mkdir(parents=True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture
def gsm8k(offline_cache):
    cache_hub_dataset(offline_cache, "openai/gsm8k", "main", MAIN)
    cache_hub_dataset(offline_cache, "openai/gsm8k", "socratic", SOCRATIC)
    return offline_cache


def _one_line(exc_info):
    msg = str(exc_info.value)
    assert "\n" not in msg and msg
    return msg


def test_hub_id_or_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("openai/gsm8k") and is_hub_id("HuggingFaceH4/ultrafeedback_binarized")
    assert is_hub_id("org/data.v2")
    for local in ("data/prompts.jsonl", "data/p.parquet", "/abs/dir", "./a/b", "~/a", "gsm8k", "a/b/c", ""):
        assert not is_hub_id(local), local
    (tmp_path / "openai" / "gsm8k").mkdir(parents=True)  # an existing local path wins
    assert not is_hub_id("openai/gsm8k")


def test_cached_hub_dataset_loads_by_id(gsm8k, tok_path):
    ds = PromptDataset.load(path="openai/gsm8k", config_name="main", field="question", tokenizer_path=tok_path)
    assert ds.texts == ["The cat was", "A dog felt"] and ds.skip_counts == {"empty": 1}
    assert ds.source == "openai/gsm8k"
    test = PromptDataset.load(path="openai/gsm8k", config_name="main", split="test", field="question",
                              tokenizer_path=tok_path)
    assert test.texts == ["My friend felt"]
    socratic = PromptDataset.load(path="openai/gsm8k", config_name="socratic", field="question",
                                  tokenizer_path=tok_path)
    assert socratic.texts == ["Why is the sky", "How does rain"]
    first = PromptDataset.load(path="openai/gsm8k", config_name="main", split="train[:1]", field="question",
                               tokenizer_path=tok_path)
    assert first.texts == ["The cat was"]


def test_hub_rows_keep_every_column(gsm8k):
    rows = read_hub_rows("openai/gsm8k", split="test", config_name="main", section="data")
    assert rows == [("row 0", {"question": "My friend felt", "answer": "4"})]
    kept, _ = read_records("openai/gsm8k", {"data.field": "question"}, "data", config_name="main")
    assert [w for w, _ in kept] == ["row 0", "row 1"]


def test_unknown_split_or_config_lists_the_available_ones(gsm8k, tok_path):
    def load(**kw):
        return PromptDataset.load(path="openai/gsm8k", field="question", tokenizer_path=tok_path, **kw)

    with pytest.raises(ValueError) as e:
        load(config_name="main", split="validation")
    assert _one_line(e) == ("data.split='validation' is not a split of 'openai/gsm8k'; available: train, test; "
                            "set data.split to one of them")
    with pytest.raises(ValueError) as e:
        load(config_name="mian")
    assert _one_line(e) == ("data.config_name='mian' is not a config of 'openai/gsm8k'; available cached locally: "
                            "main, socratic; set data.config_name to one of them")
    with pytest.raises(ValueError) as e:
        load()
    assert _one_line(e) == ("data.config_name is not set and 'openai/gsm8k' has several configs; available cached "
                            "locally: main, socratic; set data.config_name to one of them")


def test_not_cached_offline_is_one_line(offline_cache, tok_path):
    with pytest.raises(ValueError) as e:
        PromptDataset.load(path="openai/gsm8k", field="question", tokenizer_path=tok_path)
    assert _one_line(e) == ("data.path 'openai/gsm8k' (split 'train') is not in the local datasets cache and the "
                            "Hub cannot be reached (offline); download it once with network access, or point "
                            "data.path at a local file")


def test_split_and_config_of_local_sources(tmp_path, tok_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "The cat was"}\n')
    with pytest.raises(ValueError) as e:
        PromptDataset.load(path=str(p), tokenizer_path=tok_path, split="test")
    assert "data.split='test'" in _one_line(e) and "one file" in str(e.value)
    with pytest.raises(ValueError) as e:
        PromptDataset.load(path=str(p), tokenizer_path=tok_path, config_name="main")
    assert "data.config_name='main'" in _one_line(e) and "set data.config_name: null" in str(e.value)

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["A dog felt"]}),
                               "test": datasets.Dataset.from_dict({"prompt": ["My friend felt"]})})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert PromptDataset.load(path=str(tmp_path / "dict"), tokenizer_path=tok_path, split="test").texts == \
        ["My friend felt"]
    with pytest.raises(ValueError) as e:
        PromptDataset.load(path=str(tmp_path / "dict"), tokenizer_path=tok_path, split="dev")
    assert _one_line(e).startswith("data.split='dev' is not a split of") and "available: test, train" in str(e.value)


def test_ptx_reads_a_hub_dataset(gsm8k, tok_path):
    from cluster.data.ptx import PTXData

    cache_hub_dataset(gsm8k, "wiki/corpus", "default", {"train": {"text": ["The cat was happy."] * 8}})
    ptx = PTXData.load(path="wiki/corpus", field="text", tokenizer_path=tok_path, seq_len=4, builtin_policy=True)
    assert len(ptx) > 0 and ptx.source == "wiki/corpus"
    socratic = PTXData.load(path="openai/gsm8k", config_name="socratic", field="question", tokenizer_path=tok_path,
                            seq_len=2, builtin_policy=True)
    assert len(socratic) > 0
    with pytest.raises(ValueError) as e:  # gsm8k has two configs cached: which one is the user's to say
        PTXData.load(path="openai/gsm8k", field="question", tokenizer_path=tok_path, seq_len=2, builtin_policy=True)
    assert _one_line(e).startswith("ptx.config_name is not set and 'openai/gsm8k' has several configs")


def test_hub_chats_come_through_the_cache(offline_cache, tmp_path, tok_path):
    """A chat column (parquet list<struct>, as Hub chat datasets store it) reaches the template."""
    from transformers import AutoTokenizer

    chats = [[{"role": "user", "content": "The cat was"}], [{"role": "user", "content": "A dog felt"}]]
    cache_hub_dataset(offline_cache, "org/chats", "default", {"train": {"messages": chats}})
    tok = AutoTokenizer.from_pretrained(tok_path)
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %} =>"
    tok.save_pretrained(tmp_path / "chat-tok")
    ds = PromptDataset.load(path="org/chats", field="messages", tokenizer_path=str(tmp_path / "chat-tok"))
    assert ds.texts == ["[user] The cat was =>", "[user] A dog felt =>"]


@pytest.mark.parametrize("overrides, message", [
    (["data.split=test"], "data.split / data.config_name choose part of data.path, which is null"),
    (["data.config_name=main"], "data.split / data.config_name choose part of data.path, which is null"),
    (["data.path=openai/gsm8k", "data.split=''"], "data.split='' must name a split (default train)"),
    (["data.path=openai/gsm8k", "data.config_name=' '"], "data.config_name=' ' must name a config, or be null"),
])
def test_split_and_config_keys_are_checked(overrides, message):
    from cluster.config.ppo import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in _one_line(e)
