"""What the gateway reads of a worker's vLLM-style /metrics page (gateway/fleet.py parse_vllm_load)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.fleet import parse_vllm_load

VLLM_PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_cpu_blocks="None",num_gpu_blocks="192",prefix_caching_hash_algo="sha256"} 1.0
"""


def test_load_and_the_kv_capacity_are_read_from_a_vllm_page():
    assert parse_vllm_load(VLLM_PAGE) == {"running_requests": 3, "waiting_requests": 1, "kv_usage_frac": 0.25,
                                          "num_blocks": 192, "block_size": 32}


def test_a_capacity_not_known_yet_is_left_out():
    page = VLLM_PAGE.replace('num_gpu_blocks="192"', 'num_gpu_blocks="None"')
    assert "num_blocks" not in parse_vllm_load(page)


def test_engines_that_disagree_on_their_cache_config_say_nothing_of_it():
    page = VLLM_PAGE + VLLM_PAGE.splitlines()[-1].replace('engine="0"', 'engine="1"').replace(
        'block_size="32"', 'block_size="16"') + "\n"
    values = parse_vllm_load(page)
    assert "block_size" not in values and values["num_blocks"] == 192


def test_a_whole_vllm_page_reads_as_prometheus_own_parser_reads_it():
    """A page vLLM 0.32's CPU build served (~600 lines, mostly histograms): the line reader that takes
    only the four families gives what the full exposition parser gives."""
    from prometheus_client.parser import text_string_to_metric_families

    page = (Path(__file__).parent / "data" / "vllm-0.32-metrics.txt").read_text()
    families = {f.name: f for f in text_string_to_metric_families(page)}
    config = families["vllm:cache_config_info"].samples[0].labels
    assert parse_vllm_load(page) == {
        "running_requests": int(families["vllm:num_requests_running"].samples[0].value),
        "waiting_requests": int(families["vllm:num_requests_waiting"].samples[0].value),
        "kv_usage_frac": families["vllm:kv_cache_usage_perc"].samples[0].value,
        "num_blocks": int(config["num_gpu_blocks"]), "block_size": int(config["block_size"])}


def test_engines_are_summed_and_lines_without_labels_timestamps_and_other_families_are_read_right():
    page = "\n".join([
        'vllm:num_requests_running{engine="0"} 2.0 1733300000000',  # a timestamp after the value
        'vllm:num_requests_running{engine="1",model_name="a}b"} 1.0',  # a brace inside a label value
        "vllm:num_requests_waiting 4",  # no labels
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 9.0',  # another family sharing the prefix
        'vllm:kv_cache_usage_perc{engine="0"} NaN',  # no reading
    ])
    assert parse_vllm_load(page) == {"running_requests": 3, "waiting_requests": 4}


def test_a_value_that_is_not_a_number_is_an_error():
    with pytest.raises(ValueError):
        parse_vllm_load('vllm:num_requests_running{engine="0"} many')
