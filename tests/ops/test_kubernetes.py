"""The Kubernetes manifests (deploy/k8s): rendered as kustomize renders them, validated against the Kubernetes
API's schemas (kubernetes-validate ships them, so no cluster is needed), and linted for the mistakes that bite."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from shared.configuration import pool_config

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30"
"""The oldest release the manifests are for (autoscaling/v2, policy/v1, sidecar-free pods)."""
WORKLOADS = ("Deployment", "DaemonSet", "Job")
Doc = dict[str, Any]


def render(directory: Path) -> list[Doc]:
    """What `kubectl kustomize directory` gives, for the features these manifests use: resources (files and
    directories), strategic-merge patches by kind and name, namespace, images."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[Doc] = []
    for resource in kustomization.get("resources", []):
        path = (directory / resource).resolve()
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches", []):
        change = yaml.safe_load((directory / patch["path"]).read_text())
        targets = [d for d in docs if (d["kind"], d["metadata"]["name"]) == (change["kind"], change["metadata"]["name"])]
        assert len(targets) == 1, f"patch {patch['path']} matches {len(targets)} resources"
        merge(targets[0], change)
    if namespace := kustomization.get("namespace"):
        for doc in docs:
            if doc["kind"] != "Namespace":
                doc["metadata"]["namespace"] = namespace
    for image in kustomization.get("images", []):
        for container in containers(docs):
            if container["image"].split(":")[0] == image["name"]:
                container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return docs


def merge(base: Doc, patch: Doc) -> None:
    """A strategic merge: mappings key by key, lists of named items by name, anything else replaced."""
    for key, value in patch.items():
        old = base.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            merge(old, value)
        elif isinstance(old, list) and value and all(isinstance(v, dict) and "name" in v for v in [*old, *value]):
            by_name = {item["name"]: item for item in old}
            for item in value:
                if item["name"] in by_name:
                    merge(by_name[item["name"]], item)
                else:
                    old.append(item)
        else:
            base[key] = copy.deepcopy(value)


def pod_spec(doc: Doc) -> Doc:
    return doc["spec"]["template"]["spec"]


def containers(docs: list[Doc]) -> list[Doc]:
    return [c for d in docs if d["kind"] in WORKLOADS for c in pod_spec(d)["containers"]]


def problems(docs: list[Doc]) -> list[str]:
    """The mistakes that bite in production, one line each."""
    found = []
    config_maps = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in WORKLOADS}
    for name, doc in workloads.items():
        spec = pod_spec(doc)
        if not (spec.get("securityContext") or {}).get("runAsNonRoot"):
            found.append(f"{name}: not runAsNonRoot")
        for volume in spec.get("volumes", []):
            if "configMap" in volume and volume["configMap"]["name"] not in config_maps:
                found.append(f"{name}: mounts the missing ConfigMap {volume['configMap']['name']}")
        for container in spec["containers"]:
            where = f"{name}/{container['name']}"
            image = container["image"]
            if ":" not in image or image.endswith(":latest"):
                found.append(f"{where}: image {image} has no fixed tag")
            for kind in ("requests", "limits"):
                for resource in ("cpu", "memory"):
                    if resource not in (container.get("resources") or {}).get(kind, {}):
                        found.append(f"{where}: no {resource} {kind}")
            if doc["kind"] != "Job":
                for probe in ("livenessProbe", "readinessProbe"):
                    if probe not in container:
                        found.append(f"{where}: no {probe}")
            if (container.get("securityContext") or {}).get("allowPrivilegeEscalation") is not False:
                found.append(f"{where}: may escalate privileges")
            for source in container.get("envFrom", []):
                if source.get("configMapRef", {}).get("name") not in config_maps:
                    found.append(f"{where}: environment from a missing ConfigMap")
    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind in ("Service", "PodDisruptionBudget"):
            selector = doc["spec"]["selector"]
            selector = selector.get("matchLabels", selector) if kind == "PodDisruptionBudget" else selector
            if not any(selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
                       for w in workloads.values()):
                found.append(f"{kind} {name} selects no pods")
        if kind == "HorizontalPodAutoscaler" and doc["spec"]["scaleTargetRef"]["name"] not in workloads:
            found.append(f"HorizontalPodAutoscaler {name} scales nothing")
    return found


@pytest.fixture(scope="module", params=["base", "overlays/gpu"])
def rendered(request: pytest.FixtureRequest) -> list[Doc]:
    return render(K8S / request.param)


def test_every_resource_is_valid_against_the_kubernetes_api(rendered: list[Doc]) -> None:
    for doc in rendered:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_nothing_that_bites_in_production(rendered: list[Doc]) -> None:
    assert problems(rendered) == []


def test_the_lint_catches_what_it_looks_for(rendered: list[Doc]) -> None:
    broken = copy.deepcopy(rendered)
    gateway = next(d for d in broken if d["kind"] == "Deployment" and d["metadata"]["name"] == "gateway")
    container = pod_spec(gateway)["containers"][0]
    del container["readinessProbe"]
    del container["resources"]["limits"]["memory"]
    container["image"] = "modelpool:latest"
    next(d for d in broken if d["kind"] == "Service")["spec"]["selector"] = {"app.kubernetes.io/component": "nope"}
    assert problems(broken) == ["gateway/gateway: image modelpool:latest has no fixed tag",
                                "gateway/gateway: no memory limits", "gateway/gateway: no readinessProbe",
                                "Service gateway selects no pods"]


def test_the_pool_file_inside_is_a_valid_pool(rendered: list[Doc]) -> None:
    pool = next(d for d in rendered if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "modelpool-pool")
    config = pool_config(yaml.safe_load(pool["data"]["pool.yaml"]), source="modelpool-pool", environ={})
    assert config.aliases


def test_the_shape_the_deployment_guide_describes(rendered: list[Doc]) -> None:
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in rendered}
    assert by_name[("Deployment", "autoscaler")]["spec"]["replicas"] == 2  # one leads, one stands by
    assert by_name[("Deployment", "gateway")]["spec"]["replicas"] >= 2
    hpa = by_name[("HorizontalPodAutoscaler", "gateway")]["spec"]
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "modelpool_num_requests_waiting"
    assert by_name[("ConfigMap", "modelpool-env")]["data"]["MODELPOOL_STREAM_REPLICAS"] == "3"
    env = {e["name"]: e for e in pod_spec(by_name[("DaemonSet", "worker")])["containers"][0]["env"]}
    assert env["MODELPOOL_WORKER_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert by_name[("Job", "migrate")]["spec"]["template"]["spec"]["containers"][0]["command"] == ["modelpool", "migrate"]
    secrets = {e["valueFrom"]["secretKeyRef"]["name"] for c in containers(rendered) for e in c.get("env", [])
               if "secretKeyRef" in e.get("valueFrom", {})}
    roles = {"relay", "projector", "placement", "autoscaler", "gateway", "worker", "operator"}
    # Credentials only from the Secrets the guide creates: the pool's, and one per bus role.
    assert secrets == {"modelpool-credentials", *(f"modelpool-nats-{role}" for role in roles)}
    # Each workload is its own role's user on the bus, with that role's password and no other's.
    for doc in (d for d in rendered if d["kind"] in WORKLOADS):
        env = {e["name"]: e for e in pod_spec(doc)["containers"][0]["env"]}
        role = "operator" if doc["metadata"]["name"] == "migrate" else doc["metadata"]["name"]
        assert env["MODELPOOL_NATS_USER"]["value"] == role
        assert env["MODELPOOL_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": f"modelpool-nats-{role}",
                                                                              "key": "password"}
        assert {e["valueFrom"]["secretKeyRef"]["name"] for e in env.values()
                if "secretKeyRef" in e.get("valueFrom", {})} <= {"modelpool-credentials", f"modelpool-nats-{role}"}


def test_postgres_logins_are_the_owner_for_migrations_and_the_service_role_for_services(rendered: list[Doc]) -> None:
    """No URL carries a password: each pod reads its login's from a file of the Secret, the migrations the owner's."""
    for doc in rendered:
        if doc["kind"] not in WORKLOADS:
            continue
        spec = pod_spec(doc)
        container = spec["containers"][0]
        env = {e["name"]: e for e in container.get("env", [])}
        migrate = doc["metadata"]["name"] == "migrate"
        url_key, password_key = ("database-owner-url", "database-owner-password") if migrate \
            else ("database-url", "database-password")
        assert env["DATABASE_URL"]["valueFrom"]["secretKeyRef"]["key"] == url_key, doc["metadata"]["name"]
        path = env["MODELPOOL_DATABASE_PASSWORD_FILE"]["value"]
        mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["items"] == [{"key": password_key, "path": path.rsplit("/", 1)[1]}]
        assert volume["secret"]["defaultMode"] == 0o440 and mount["readOnly"] is True
        assert ("MODELPOOL_DATABASE_SERVICE_ROLE" in env) == migrate


def test_the_gpu_overlay_puts_workers_on_gpus_with_a_vllm_image() -> None:
    worker = next(d for d in render(K8S / "overlays" / "gpu") if d["kind"] == "DaemonSet")
    spec = pod_spec(worker)
    container = spec["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["nodeSelector"] == {"modelpool.io/worker": "true", "nvidia.com/gpu.present": "true"}
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    assert container["image"].split(":")[0].endswith("modelpool-vllm")
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MODELPOOL_WORKER_GPU_MEMORY_GB"] == "auto"  # the node's GPUs say what they hold
    assert [v["name"] for v in spec["volumes"]] == ["tmp", "pool", "database-password", "cache"]


def test_the_nats_values_keep_three_jetstream_servers_with_the_bus_users() -> None:
    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    assert values["config"]["cluster"] == {"enabled": True, "replicas": 3}
    assert values["config"]["jetstream"]["enabled"] and values["config"]["jetstream"]["fileStore"]["pvc"]["enabled"]
    # The users' list, from its Secret, mounted where the included path finds it.
    included = values["config"]["merge"]["$include"]
    (mount,) = [p["value"] for p in values["container"]["patch"] if p["value"]["name"] == "modelpool-users"]
    (volume,) = [p["value"] for p in values["podTemplate"]["patch"] if p["value"]["name"] == "modelpool-users"]
    assert included == "./modelpool-users/nats-server.conf" and mount["mountPath"] == "/etc/nats-config/modelpool-users"
    assert volume["secret"]["secretName"] == "modelpool-nats-users"
