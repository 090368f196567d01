"""Loading a Hugging Face model folder: config, weights (sharded too), tokenizer, chat template, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from worker.engine.sampling_params import SamplingParams
from worker.executor.base import SeqChunk, StepBatch
from worker.executor.torch_executor import TorchExecutor
from worker.model.config import ModelConfig, load_model_config
from worker.model.errors import ModelFileNotFoundError, UnsupportedModelError
from worker.model.loader import load_model
from worker.model.tokenizer import load_tokenizer

from tests.tiny_models import CHAT_TEMPLATE

from .conftest import read_config, write_config

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"},
            {"role": "assistant", "content": "Hello. How can I help?"}, {"role": "user", "content": "Ünïcode 🚀"}]
PROMPT = [5, 17, 200, 33, 91, 4, 250]


@pytest.fixture
def model_copy(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "model"))


def last_logits(model_dir: Path) -> torch.Tensor:
    executor = TorchExecutor.from_pretrained(model_dir, block_size=4, num_blocks=4)
    chunk = SeqChunk(0, PROMPT, 0, [0, 1], SamplingParams(temperature=0.0))
    return executor.forward_logits(StepBatch([chunk]))[0]


@pytest.mark.parametrize("filename, loader", [
    ("config.json", load_model_config),
    ("model.safetensors", load_model),
    ("tokenizer.json", load_tokenizer),
], ids=["config", "weights", "tokenizer"])
def test_missing_file_raises_an_error_naming_it(model_copy, filename, loader):
    (model_copy / filename).unlink()
    expected = "safetensors" if filename.endswith("safetensors") else filename
    with pytest.raises(ModelFileNotFoundError, match=expected) as info:
        loader(model_copy)
    assert isinstance(info.value, FileNotFoundError)


def test_unsupported_architecture_is_named_in_the_error(model_copy):
    config = read_config(model_copy)
    config["architectures"] = ["GPT2LMHeadModel"]
    write_config(model_copy, config)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel") as info:
        load_model_config(model_copy)
    assert isinstance(info.value, ValueError)


def test_unsupported_rope_type_is_named_in_the_error(model_copy):
    config = read_config(model_copy)
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    write_config(model_copy, config)
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_model_config(model_copy)


def test_rope_theta_and_rope_parameters_load_the_same_model(tiny_llama_dir, model_copy):
    config = read_config(model_copy)
    assert config["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    del config["rope_parameters"]
    config["rope_theta"] = 10000.0
    write_config(model_copy, config)
    assert load_model_config(model_copy).rope == load_model_config(tiny_llama_dir).rope
    torch.testing.assert_close(last_logits(model_copy), last_logits(tiny_llama_dir), atol=1e-5, rtol=0)


def test_llama3_rope_scaling_from_transformers_4_keys():
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500000.0,
           "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    config = ModelConfig.from_hf_dict(raw)
    assert (config.rope.rope_type, config.rope.theta, config.rope.factor) == ("llama3", 500000.0, 32.0)
    assert config.num_kv_heads == 2 and config.head_dim == 4


def test_sharded_checkpoint_with_index_loads(tiny_llama_dir, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="60KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_llama_dir / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    ours, whole = load_model(sharded).state_dict(), load_model(tiny_llama_dir).state_dict()
    assert ours.keys() == whole.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, whole[name]), name


def test_missing_weight_names_the_tensor(model_copy):
    from safetensors.torch import load_file, save_file

    weights = load_file(model_copy / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, model_copy / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match="model.norm.weight"):
        load_model(model_copy)


def test_a_missing_part_of_a_fused_projection_is_named_as_the_checkpoint_spells_it(model_copy):
    from safetensors.torch import load_file, save_file

    weights = load_file(model_copy / "model.safetensors")
    del weights["model.layers.0.self_attn.k_proj.weight"]
    save_file(weights, model_copy / "model.safetensors")
    expected = r"missing \['model.layers.0.self_attn.k_proj.weight'\], unexpected \[\]"
    with pytest.raises(UnsupportedModelError, match=expected):
        load_model(model_copy)


def test_tied_embeddings_share_the_embedding_matrix(tiny_tied_llama3_dir):
    model = load_model(tiny_tied_llama3_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_tokenizer_special_ids_and_generation_config_eos(model_copy):
    (model_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3], "bos_token_id": 0}))
    tokenizer = load_tokenizer(model_copy)
    assert tokenizer.eos_token_ids == (1, 3)
    assert tokenizer.bos_token_id == 0
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(model_copy)
    text = "Hello world, paged attention! 東京"
    assert tokenizer.encode(text) == reference(text).input_ids
    assert tokenizer.decode(tokenizer.encode(text)) == text


def use_tokenizer_config_template(model_dir: Path, template: str) -> None:
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("source", ["chat_template.jinja", "tokenizer_config.json"])
@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen-prompt", "no-gen-prompt"])
def test_chat_template_renders_like_transformers(model_copy, source, add_generation_prompt):
    if source == "tokenizer_config.json":
        use_tokenizer_config_template(model_copy, CHAT_TEMPLATE)
    assert (model_copy / "chat_template.jinja").is_file() == (source == "chat_template.jinja")
    ours = load_tokenizer(model_copy).apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(model_copy)
    expected = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == expected
    assert ours.startswith("<s><|im_start|>system\nBe brief.<|im_end|>\n")


def test_continue_final_message_stops_after_the_last_message(model_copy):
    messages = MESSAGES[:3]
    ours = load_tokenizer(model_copy).apply_chat_template(messages, continue_final_message=True)
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(model_copy)
    expected = reference.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert ours == expected and ours.endswith("How can I help?")


def test_template_helpers_match_transformers(model_copy):
    template = ("{{ strftime_now('%Y') }}|{{ messages | tojson }}|{% set ns = namespace(n=0) %}"
                "{% for m in messages %}{% set ns.n = ns.n + 1 %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{% generation %}{{ m['role'] }}{% endgeneration %}{% endfor %}{{ ns.n }}")
    use_tokenizer_config_template(model_copy, template)
    ours = load_tokenizer(model_copy).apply_chat_template(MESSAGES)
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(model_copy)
    assert ours == reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert "Ünïcode 🚀" in ours


def test_raise_exception_in_a_template_surfaces(model_copy):
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="bad role tool"):
        load_tokenizer(model_copy).apply_chat_template([{"role": "tool", "content": "x"}])
