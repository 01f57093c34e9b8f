"""deploy/kuberay: the RayJob (and its ConfigMap), the long-lived RayCluster and the example Secret
checked against KubeRay's ray.io/v1 API and Kubernetes' core/v1 objects (tests/schemas/kuberay_v1.yaml,
written out field by field from KubeRay's CRDs), and against what they name: the image the Dockerfile builds, the
console script and job spec the entrypoint runs, the Secret every pod takes its credentials from,
the shared memory the pods mount, the PodMonitor's port, and the preemption grace periods."""

from __future__ import annotations

import copy
import importlib
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from orchestrator.spec.job_spec import load_spec
from orchestrator.spec.secrets import looks_like_credential
from tests._deploy import (
    DOCKERFILES,
    ROOT,
    build_args,
    console_scripts,
    gpu_image,
    instructions,
    kubernetes_bytes,
    yaml_documents,
)

SCHEMA = yaml.safe_load((ROOT / "tests/schemas/kuberay_v1.yaml").read_text())


def _problems(document: dict, kind: str | None = None) -> list[str]:
    """Every way `document` breaks the schema of its kind, as 'path: message' lines."""
    schema = {key: value for key, value in SCHEMA.items() if key != "oneOf"}
    schema["$ref"] = f"#/$defs/{kind or document['kind']}"
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in sorted(validator.iter_errors(document), key=lambda e: list(map(str, e.absolute_path)))]


def _rayjob() -> tuple[dict, dict]:
    config_map, rayjob = yaml_documents("kuberay/rayjob.yaml")
    return config_map, rayjob


def _secret() -> dict:
    [secret] = yaml_documents("kuberay/secret.example.yaml")
    return secret


def _clusters() -> dict[str, dict]:
    """The RayCluster specs: the RayJob's own and the long-lived RayCluster's."""
    _, rayjob = _rayjob()
    [raycluster] = yaml_documents("kuberay/raycluster.yaml")
    return {"rayjob": rayjob["spec"]["rayClusterSpec"], "raycluster": raycluster["spec"]}


def _groups(cluster: dict) -> list[dict]:
    """The head group, then each worker group: each has rayStartParams and a pod template."""
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


def test_the_schema_is_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


@pytest.mark.parametrize("path", ["kuberay/rayjob.yaml", "kuberay/raycluster.yaml", "kuberay/secret.example.yaml"])
def test_every_manifest_matches_kuberays_and_kubernetes_api(path):
    for document in yaml_documents(path):
        assert not _problems(document), f"{path} ({document['kind']}):\n" + "\n".join(_problems(document))
        assert jsonschema.Draft202012Validator(SCHEMA).is_valid(document)


def _set(document: dict, path: str, value) -> dict:
    """A copy of `document` with `value` at the dotted `path` (integers index lists); None deletes."""
    changed = copy.deepcopy(document)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = changed
    for part in parents:
        node = node[part]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return changed


HEAD = "spec.rayClusterSpec.headGroupSpec"
HEAD_CONTAINER = f"{HEAD}.template.spec.containers.0"


@pytest.mark.parametrize(("path", "value", "expected"), [
    ("spec.backofflimit", 3, "'backofflimit' was unexpected"),  # misspelt: the API server would drop it
    ("spec.submitterConfig", {"backoffLimit": "3"}, "'3' is not of type 'integer'"),
    ("spec.rayClusterSpec.headGroupSpec", None, "'headGroupSpec' is a required property"),
    ("spec.rayClusterSpec.workerGroupSpecs.0.groupName", None, "'groupName' is a required property"),
    (f"{HEAD_CONTAINER}.envfrom", [], "'envfrom' was unexpected"),
    (f"{HEAD_CONTAINER}.envFrom.0.secretRef.nmae", "x", "'nmae' was unexpected"),
    (f"{HEAD_CONTAINER}.resources.limits.memory", "32 Gi", "'32 Gi' is not valid"),
    (f"{HEAD_CONTAINER}.ports.4.name", "undying-metrics-port", "is too long"),
    (f"{HEAD}.template.spec.volumes.1.configMap", {"name": "x"}, "has too many properties"),
    (f"{HEAD}.template.spec.volumes.1.emptyDir.medium", "memory", "'memory' is not one of"),
    (f"{HEAD}.rayStartParams.num-gpus", 0, "0 is not of type 'string'"),
    ("spec.submissionMode", "K8sJob", "'K8sJob' is not one of"),
    ("metadata.name", "undying.llama", "does not match"),  # a DNS-1123 subdomain, not the DNS-1035 label
    ("metadata.name", "l" * 48, "is too long"),  # its cluster's name appends 6 characters to it
])
def test_the_schema_refuses_what_kuberay_would_drop_or_refuse(path, value, expected):
    _, rayjob = _rayjob()
    problems = _problems(_set(rayjob, path, value))
    assert any(expected in p for p in problems), f"{path}={value!r}: {problems}"


def test_a_failed_job_is_retried_whole_on_a_new_cluster():
    _, rayjob = _rayjob()
    assert rayjob["spec"]["backoffLimit"] >= 1
    # submitterConfig.backoffLimit retries only the pod that runs `ray job submit`.
    assert "submitterConfig" not in rayjob["spec"]
    assert rayjob["spec"]["shutdownAfterJobFinishes"] is True


def test_the_entrypoint_is_the_packages_console_script_running_the_mounted_spec(tmp_path):
    config_map, rayjob = _rayjob()
    command = shlex.split(rayjob["spec"]["entrypoint"])
    # The console script the image's `pip install` puts on the PATH.
    module, _, function = console_scripts()[command[0]].partition(":")
    assert callable(getattr(importlib.import_module(module), function))
    args = importlib.import_module(module)._parser().parse_args(command[1:])
    assert args.command == "run"
    # The spec file it names is the ConfigMap's job.yaml, mounted into the head, and it passes
    # undying's own checks.
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    mount = next(m for m in head["containers"][0]["volumeMounts"] if m["name"] == "job-spec")
    volume = next(v for v in head["volumes"] if v["name"] == "job-spec")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert Path(args.spec).parent == Path(mount["mountPath"]) and Path(args.spec).name in config_map["data"]
    (tmp_path / "job.yaml").write_text(config_map["data"][Path(args.spec).name])
    spec = load_spec(str(tmp_path / "job.yaml"), args.overrides)
    assert spec.checkpoint.url.startswith("s3://"), "the Secret's AWS_* variables are for an s3:// bucket"


def test_the_long_lived_cluster_has_the_rayjobs_pods_without_its_job_spec():
    clusters = _clusters()
    job_pods = copy.deepcopy(clusters["rayjob"])
    head = job_pods["headGroupSpec"]["template"]["spec"]
    head["volumes"] = [v for v in head["volumes"] if v["name"] != "job-spec"]
    mounts = head["containers"][0]["volumeMounts"]
    head["containers"][0]["volumeMounts"] = [m for m in mounts if m["name"] != "job-spec"]
    for pods in (job_pods, clusters["raycluster"]):  # each its own disruption budget (kuberay/pdb.yaml)
        for group in pods["workerGroupSpecs"]:
            group["template"]["metadata"]["labels"].pop("undying.io/budget")
    assert clusters["raycluster"] == job_pods


@pytest.mark.parametrize("which", ["rayjob", "raycluster"])
def test_every_pod_takes_its_credentials_from_the_shipped_secret(which):
    secret = _secret()
    name = secret["metadata"]["name"]
    for group in _groups(_clusters()[which]):
        container = group["template"]["spec"]["containers"][0]
        assert {"secretRef": {"name": name}} in container.get("envFrom", []), container["name"]
        # No credential written into the manifest itself.
        assert not [e["name"] for e in container.get("env", []) if looks_like_credential(e["name"]) and "value" in e]
    values = secret["stringData"]
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(values)
    credentials = [key for key in values if looks_like_credential(key)]
    assert credentials and all(values[key].startswith("REPLACE_ME") for key in credentials), (
        "every credential in the example must be a marked placeholder")
    assert "REPLACE_ME" in (ROOT / "deploy/kuberay/secret.example.yaml").read_text().split("apiVersion")[0]


@pytest.mark.parametrize("which", ["rayjob", "raycluster"])
def test_every_pod_has_in_memory_shared_memory_sized_above_rays_object_store(which):
    for group in _groups(_clusters()[which]):
        spec, params = group["template"]["spec"], group["rayStartParams"]
        container = spec["containers"][0]
        [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        shm = volume["emptyDir"]
        assert shm["medium"] == "Memory" and "sizeLimit" in shm, container["name"]
        # The emptyDir counts against the pod's memory; Ray's object store must fit in /dev/shm.
        assert kubernetes_bytes(shm["sizeLimit"]) < kubernetes_bytes(container["resources"]["limits"]["memory"])
        assert int(params["object-store-memory"]) < kubernetes_bytes(shm["sizeLimit"]), container["name"]


@pytest.mark.parametrize("which", ["rayjob", "raycluster"])
def test_pods_run_the_image_the_dockerfile_builds_as_its_user(which):
    cluster = _clusters()[which]
    [user] = [i.args for i in instructions(DOCKERFILES[0]) if i.keyword == "USER"]
    uid, gid = (int(x) for x in user.split(":"))
    assert cluster["rayVersion"] == build_args(DOCKERFILES[0])["RAY_VERSION"]
    for pod in (group["template"] for group in _groups(cluster)):
        assert [c["image"] for c in pod["spec"]["containers"]] == [gpu_image()]
        context = pod["spec"]["securityContext"]
        assert context["runAsNonRoot"] is True and (context["runAsUser"], context["runAsGroup"]) == (uid, gid)


def _restricted_problems(pod: dict) -> list[str]:
    """What the "restricted" Pod Security Standard refuses in `pod` (a pod template's spec), of the
    settings a pod must give itself: non-root, RuntimeDefault seccomp, no privilege escalation, no
    capabilities."""
    out, context = [], pod.get("securityContext", {})
    if context.get("runAsNonRoot") is not True:
        out.append("runAsNonRoot")
    if context.get("seccompProfile", {}).get("type") != "RuntimeDefault":
        out.append("seccompProfile")
    for container in pod["containers"]:
        own = container.get("securityContext", {})
        if own.get("allowPrivilegeEscalation") is not False:
            out.append(f"{container['name']}: allowPrivilegeEscalation")
        if own.get("capabilities", {}).get("drop") != ["ALL"] or own.get("capabilities", {}).get("add"):
            out.append(f"{container['name']}: capabilities")
    return out


def test_every_pod_passes_the_restricted_pod_security_level():
    _, rayjob = _rayjob()
    pods = [g["template"]["spec"] for cluster in _clusters().values() for g in _groups(cluster)]
    submitter = rayjob["spec"]["submitterPodTemplate"]["spec"]
    for pod in [*pods, submitter]:
        assert _restricted_problems(pod) == [], pod["containers"][0]["name"]
    # The submitter runs `ray job submit` only: the CPU image of the same release, its command KubeRay's.
    [container] = submitter["containers"]
    assert container["image"] == gpu_image().removesuffix("-gpu") + "-cpu" and "command" not in container


def test_the_head_exposes_the_metrics_the_podmonitor_scrapes(tmp_path):
    config_map, rayjob = _rayjob()
    [monitor] = yaml_documents("kuberay/podmonitor.yaml")
    assert monitor["kind"] == "PodMonitor" and monitor["apiVersion"] == "monitoring.coreos.com/v1"
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    (tmp_path / "job.yaml").write_text(config_map["data"]["job.yaml"])
    spec = load_spec(str(tmp_path / "job.yaml"), [])
    ports = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert ports[endpoint["port"]] == spec.monitor.port and spec.monitor.host == "0.0.0.0"
    assert "honorLabels" not in endpoint  # the job's name is the series' own undying_job label
    selector = dict(monitor["spec"]["selector"]["matchLabels"])
    assert selector.pop("ray.io/node-type") == "head"  # KubeRay's own label
    assert selector.items() <= head["metadata"]["labels"].items()
    workers = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    gpus = sum(w["replicas"] * int(w["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
               for w in workers)
    assert gpus == spec.world_size * spec.resources.gpus_per_rank
    # A preempted job checkpoints within elastic.preemption_grace_s: Ray and Kubernetes wait longer.
    env = {e["name"]: e["value"] for e in head["spec"]["containers"][0]["env"]}
    grace = spec.elastic.preemption_grace_s
    assert grace < int(env["RAY_JOB_STOP_WAIT_TIME_S"]) < head["spec"]["terminationGracePeriodSeconds"]
    assert all(w["template"]["spec"]["terminationGracePeriodSeconds"] > grace for w in workers)
    # A head pod ended by Kubernetes stops its jobs first (SIGTERM reaches `ray start`, not a driver):
    # the hook is the CLI's own command, and it waits past Ray's SIGKILL but within the pod's grace.
    from orchestrator.cli.main import _parser

    hook = head["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[0] == "undying"
    parsed = _parser().parse_args(hook[1:])
    assert parsed.command == "stop-jobs" and parsed.address == "http://127.0.0.1:8265"
    assert int(env["RAY_JOB_STOP_WAIT_TIME_S"]) < parsed.wait < head["spec"]["terminationGracePeriodSeconds"]


@pytest.mark.parametrize("which", ["rayjob", "raycluster"])
def test_a_gpu_pod_drains_its_node_before_it_ends_and_tolerates_the_gpu_taint(which):
    # A worker pod ended by Kubernetes becomes a Ray drain (its ranks move at a checkpoint, no work
    # lost): the hook is the CLI's own command, its deadline long enough for a checkpointed stop
    # (the preemption grace) and inside the pod's grace, so the pod's SIGKILL never cuts it short.
    from orchestrator.cli.drain_node import FINISH_S
    from orchestrator.cli.main import _parser
    from orchestrator.spec.elastic import ElasticConfig

    for group in _clusters()[which]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        container = pod["containers"][0]
        hook = container["lifecycle"]["preStop"]["exec"]["command"]
        parsed = _parser().parse_args(hook[1:])
        assert hook[0] == "undying" and parsed.command == "drain-node" and parsed.node_id is None
        assert ElasticConfig().preemption_grace_s < parsed.wait
        assert parsed.wait + FINISH_S < pod["terminationGracePeriodSeconds"]  # the command's own limit
        if "nvidia.com/gpu" in container["resources"]["limits"]:
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_each_disruption_budget_evicts_its_own_gpu_pods_one_at_a_time_and_leaves_the_head_alone():
    budgets = yaml_documents("kuberay/pdb.yaml")
    assert len(budgets) == len(_clusters())
    for budget in budgets:
        assert budget["apiVersion"] == "policy/v1" and budget["kind"] == "PodDisruptionBudget"
        # An operator's pods (a RayCluster's) take an integer minAvailable only: replicas - 1.
        assert set(budget["spec"]) == {"minAvailable", "selector"}
    for cluster in _clusters().values():
        head, *workers = _groups(cluster)
        # Exactly one budget selects this cluster's GPU pods, and it selects no other cluster's.
        [budget] = [b for b in budgets if all(b["spec"]["selector"]["matchLabels"].items()
                                              <= w["template"]["metadata"]["labels"].items() for w in workers)]
        assert [budget["spec"]["minAvailable"]] == [w["replicas"] - 1 for w in workers]
        selector = budget["spec"]["selector"]["matchLabels"]
        assert not selector.items() <= head["template"]["metadata"]["labels"].items()
        assert head["template"]["metadata"]["annotations"] == {"karpenter.sh/do-not-disrupt": "true"}
    others = [[w["template"]["metadata"]["labels"] for w in _groups(c)[1:]] for c in _clusters().values()]
    for budget in budgets:
        selector = budget["spec"]["selector"]["matchLabels"]
        assert sum(any(selector.items() <= labels.items() for labels in cluster) for cluster in others) == 1


def test_the_documented_apply_commands_apply_the_budget():
    for doc in ("deploy/README.md", "deploy/kuberay/rayjob.yaml", "deploy/kuberay/raycluster.yaml"):
        text = (ROOT / doc).read_text()
        applies = [line for line in text.splitlines() if "kubectl apply -f deploy/kuberay/ray" in line]
        assert applies and all("deploy/kuberay/pdb.yaml" in line for line in applies), (doc, applies)
