"""Parts several benchmarks share: the fake worker, a raw HTTP load client, the gateway as benchmarks
run it, the proxy harness (fixed upstream, wrk, proxies side by side), trees of another commit, the
machine's limits. Library code: no benchmark is imported here."""
