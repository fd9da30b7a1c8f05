"""deploy/ and docs/deploy.md: every manifest parses, every `disagmoe` command in them is a real
command of the CLI whose config validates, and the GPU groups match the configs they run."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml
from typer.main import get_command

from disagmoe.cli.app import app
from disagmoe.config import load_train_config

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = sorted((REPO / "deploy").rglob("*.yaml"))
COMMAND = re.compile(r"(?:^|(?<=[\s;&|\"']))disagmoe\s+[a-z][^;&|\n\"']*")  # `disagmoe <subcommand> ...`


def documents(path: Path) -> list:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def strings(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for value in node.values() for s in strings(value)]
    if isinstance(node, list):
        return [s for value in node for s in strings(value)]
    return []


def commands_in(texts: list[str]) -> list[str]:
    return [m.group(0).strip() for text in texts for m in COMMAND.finditer(text)]


def doc_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "docs" / "deploy.md").read_text(), re.S)
    return commands_in([line for block in blocks for line in block.splitlines()])


def check_command(command: str) -> None:
    """Parse `command` with the CLI (subcommands, options, value types); validate its config."""
    args = shlex.split(command)
    assert args[0] == "disagmoe", command
    cli = get_command(app)
    ctx = cli.context_class(cli, info_name="disagmoe")
    path = ["disagmoe"]
    args = args[1:]
    while hasattr(cli, "list_commands"):  # a group: the next word names its subcommand
        name = args.pop(0)
        cli = cli.get_command(ctx, name)
        assert cli is not None, f"{command}: `{' '.join(path)}` has no subcommand {name!r}"
        path.append(name)
        ctx = cli.context_class(cli, info_name=name, parent=ctx)
    params = cli.make_context(path[-1], args, parent=ctx.parent).params  # raises on a bad option or value
    config = params.get("config") or (params.get("path") if path[1:] == ["config", "check"] else None)
    if config is not None:
        load_train_config(REPO / config, list(params.get("overrides") or []))


def manifest_commands(path: Path) -> list[str]:
    return commands_in([s for doc in documents(path) for s in strings(doc)])


def ray_jobs() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in MANIFESTS for doc in documents(path) if doc.get("kind") == "RayJob"]


def test_there_are_manifests_of_every_kind():
    kinds = {doc.get("kind") for path in MANIFESTS for doc in documents(path)}
    assert {"RayCluster", "RayJob"} <= kinds
    assert any("available_node_types" in doc for path in MANIFESTS for doc in documents(path))  # the launcher
    assert (REPO / "deploy" / "Dockerfile").is_file()


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_disagmoe_command_of_a_manifest_is_real(path):
    for command in manifest_commands(path):
        check_command(command)


@pytest.mark.parametrize("job", ray_jobs(), ids=lambda j: j[1]["metadata"]["name"])
def test_every_ray_job_trains_a_config_whose_gpus_match_its_worker_groups(job):
    path, doc = job
    entrypoint = doc["spec"]["entrypoint"]
    assert commands_in([entrypoint]) == [entrypoint]
    check_command(entrypoint)
    args = shlex.split(entrypoint)
    assert args[1] == "train"
    cfg = load_train_config(REPO / args[args.index("--config") + 1])
    gpus = sum(int(group["replicas"]) * int(c["resources"]["limits"].get("nvidia.com/gpu", 0))
               for group in doc["spec"]["rayClusterSpec"]["workerGroupSpecs"]
               for c in group["template"]["spec"]["containers"])
    world = cfg.attention_ranks + cfg.expert_ranks if cfg.mode == "disaggregated" else cfg.colocated_ranks
    assert (cfg.device, cfg.transport, cfg.ray_address) == ("cuda", "nccl", "auto")
    assert gpus == world, f"{path.name}: {gpus} GPUs in the worker groups, the config runs {world} ranks"
    assert any(key.startswith("NCCL_") for key in cfg.env), "the transport settings belong in the config's env"


def _pods(doc: dict) -> list[dict]:
    spec = doc["spec"].get("rayClusterSpec", doc["spec"])
    return [spec["headGroupSpec"]["template"]["spec"], *(g["template"]["spec"] for g in spec["workerGroupSpecs"])]


@pytest.mark.parametrize("path", [p for p in MANIFESTS if any(d.get("kind") in ("RayCluster", "RayJob")
                                                               for d in documents(p))], ids=lambda p: p.name)
def test_every_ray_pod_runs_the_image_with_token_auth(path):
    for doc in documents(path):
        if doc.get("kind") not in ("RayCluster", "RayJob"):
            continue
        pods = _pods(doc) + ([doc["spec"]["submitterPodTemplate"]["spec"]] if doc["kind"] == "RayJob" else [])
        for pod in pods:
            for container in pod["containers"]:
                env = {e["name"]: e for e in container["env"]}
                assert container["image"].startswith("disagmoe:")
                assert env["RAY_AUTH_MODE"]["value"] == "token"
                assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "disagmoe-ray-token"


def test_the_nvl72_job_stays_inside_one_nvlink_domain():
    (path, doc), = [(p, d) for p, d in ray_jobs() if "nvl72" in d["metadata"]["name"]]
    (group,) = doc["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    pod = group["template"]
    labels = pod["metadata"]["labels"]
    (rule,) = pod["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert rule["topologyKey"] == "nvidia.com/gpu.clique" and rule["labelSelector"]["matchLabels"].items() <= labels.items()
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 18
    (domain,) = [d for d in documents(path) if d.get("kind") == "ComputeDomain"]
    assert domain["spec"]["numNodes"] == 18
    claim = domain["spec"]["channel"]["resourceClaimTemplate"]["name"]
    assert pod["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == claim
    assert load_train_config(REPO / "configs/gb200-nvl72-qwen3-235b.yaml").hardware == "gb200-nvl72"


def test_the_launcher_starts_ray_with_token_auth_and_checks_a_config():
    (doc,) = documents(REPO / "deploy" / "ray-cluster-aws.yaml")
    assert all("RAY_AUTH_MODE=token ray start" in c for c in doc["head_start_ray_commands"][1:]
               + doc["worker_start_ray_commands"][1:])
    assert "~/.ray/auth_token" in doc["file_mounts"]
    assert manifest_commands(REPO / "deploy" / "ray-cluster-aws.yaml")


def test_the_dockerfile_installs_the_gpu_extra_on_a_cuda_pytorch_base():
    text = (REPO / "deploy" / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", text, re.M).group(1)
    assert "pytorch" in base and "cuda" in base and re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.M)
    assert 'pip install ".[gpu]"' in text and "COPY configs" in text
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "gpu" in extras


def test_every_disagmoe_command_in_the_deploy_guide_is_real():
    commands = doc_commands()
    assert len(commands) >= 5
    for command in commands:
        check_command(command)


@pytest.mark.parametrize("command, message", [
    ("disagmoe trian --config configs/tiny-cpu.yaml", "no subcommand 'trian'"),
    ("disagmoe train --config configs/missing.yaml", "cannot read"),
    ("disagmoe train --confg configs/tiny-cpu.yaml", "confg"),
    ("disagmoe config chek configs/tiny-cpu.yaml", "no subcommand 'chek'"),
])
def test_the_command_check_catches_what_it_must(command, message):
    with pytest.raises(Exception, match=message):
        check_command(command)
