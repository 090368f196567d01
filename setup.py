"""Only the optional C extensions; the project's metadata lives in pyproject.toml.

router._blockhash computes chained block keys in one call, router._mask_lookup a prompt's
prefix holders in the KV index (router/block_keys.py and router/mask_table.py fall back to pure
Python without them). optional=True: an install without a C compiler warns and still succeeds.
"""

import sys

from setuptools import Extension, setup

FLAGS = [] if sys.platform == "win32" else ["-O3"]

setup(
    ext_modules=[
        Extension(name, sources=[f"{name.replace('.', '/')}.c"], extra_compile_args=FLAGS, optional=True)
        for name in ("router._blockhash", "router._mask_lookup")
    ]
)
