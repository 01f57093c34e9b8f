"""deploy/ray/cluster.yaml, Ray's cluster launcher config: valid under Ray's own cluster schema,
every node on the undying image (nothing installed at set-up), the dashboard on the head's
loopback only (reached through `ray dashboard`'s SSH tunnel), and shared memory sized above
Ray's object store and a `ray job stop` wait above the preemption grace, as in the KubeRay manifests."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import ray.autoscaler

from tests._deploy import docker_bytes, gpu_image, kubernetes_bytes, yaml_documents


def _config() -> dict:
    [config] = yaml_documents("ray/cluster.yaml")
    return config


def _flag(command: str, name: str) -> str | None:
    match = re.search(rf"--{name}[= ](\S+)", command)
    return match[1] if match else None


def test_cluster_config_matches_rays_schema():
    config = _config()
    schema_path = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    jsonschema.validate(config, json.loads(schema_path.read_text()))
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"]["GPU"] == 0, "ranks must not land on the head"
    assert any(t["resources"].get("GPU", 0) > 0 for t in types.values())


def test_every_node_runs_the_undying_image_and_installs_nothing():
    config = _config()
    assert config["docker"]["image"] == gpu_image()
    assert not config.get("head_image") and not config.get("worker_image")
    commands = " ".join(command for key in ("initialization_commands", "setup_commands", "head_setup_commands",
                                            "worker_setup_commands") for command in config.get(key) or [])
    assert "pip install" not in commands and "git+" not in commands, commands


def test_the_dashboard_listens_on_the_heads_loopback_only():
    [start] = [c for c in _config()["head_start_ray_commands"] if "ray start" in c]
    assert _flag(start, "dashboard-host") == "127.0.0.1"


def test_shared_memory_holds_rays_object_store_on_every_node():
    config = _config()
    docker = config["docker"]
    # The launcher runs containers with --net=host, where `-p` is ignored.
    assert not [o for o in docker["run_options"] if o.startswith(("-p ", "--publish"))]
    for role in ("head", "worker"):
        [shm] = [_flag(o, "shm-size") for o in docker[f"{role}_run_options"] if "--shm-size" in o]
        [start] = [c for c in config[f"{role}_start_ray_commands"] if "ray start" in c]
        assert int(_flag(start, "object-store-memory")) < docker_bytes(shm), role


def test_sizes_match_the_kuberay_pods():
    config = _config()
    _, rayjob = yaml_documents("kuberay/rayjob.yaml")
    cluster = rayjob["spec"]["rayClusterSpec"]
    groups = {"head": cluster["headGroupSpec"], "worker": cluster["workerGroupSpecs"][0]}
    for role, group in groups.items():
        [start] = [c for c in config[f"{role}_start_ray_commands"] if "ray start" in c]
        assert _flag(start, "object-store-memory") == group["rayStartParams"]["object-store-memory"], role
        [shm] = [_flag(o, "shm-size") for o in config["docker"][f"{role}_run_options"] if "--shm-size" in o]
        [volume] = [v for v in group["template"]["spec"]["volumes"] if v["name"] == "dshm"]
        assert docker_bytes(shm) == kubernetes_bytes(volume["emptyDir"]["sizeLimit"]), role


def test_every_worker_watches_for_a_spot_notice_on_its_provider():
    # A spot VM's two-minute notice becomes a Ray drain: the command is the CLI's own, for the
    # provider's cloud, one watcher per node (flock), in the background after `ray start`.
    from orchestrator.cli.main import _parser

    config = _config()
    commands = config["worker_start_ray_commands"]
    [watch] = [c for c in commands if "spot-watch" in c]
    assert commands.index(watch) > max(i for i, c in enumerate(commands) if "ray start" in c)
    words = watch.split()
    assert words[:4] == ["nohup", "flock", "-n", "/tmp/undying-spot-watch.lock"] and watch.rstrip().endswith("&")
    parsed = _parser().parse_args(words[5:words.index(">>")])  # appended: a restart keeps the log
    assert words[4] == "undying" and parsed.command == "spot-watch"
    assert parsed.cloud == config["provider"]["type"] and parsed.address == "auto"


def test_ray_job_stop_waits_past_the_preemption_grace_on_the_head():
    # Ray's job supervisor runs on the head and reads RAY_JOB_STOP_WAIT_TIME_S from its environment:
    # `ray job stop` SIGKILLs the driver that long after its SIGTERM, so it must outlast the driver's
    # preemption checkpoint, as on KubeRay's head.
    from orchestrator.spec.elastic import ElasticConfig

    options = _config()["docker"]["head_run_options"]
    [wait] = [o.split("=", 1)[1] for o in options if o.startswith("-e RAY_JOB_STOP_WAIT_TIME_S=")]
    assert int(wait) > ElasticConfig().preemption_grace_s
    _, rayjob = yaml_documents("kuberay/rayjob.yaml")
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert wait == {e["name"]: e["value"] for e in head["env"]}["RAY_JOB_STOP_WAIT_TIME_S"]
