"""What the gateway reads of a worker's vLLM-style /metrics page (gateway/fleet.py parse_vllm_load)."""

from __future__ import annotations

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
