"""The deployment kit (config/deploy/) without a container runtime or a cluster: the Kubernetes
manifests against Kubernetes' schemas (kubernetes-validate, offline), the KServe resources
against config/deploy/schemas/kserve.schema.json (core types by reference to the same Kubernetes
schemas), the Dockerfile parsed, the systemd unit read; every `pagedserve` command line in them
parses with the real CLI, and the probes, ports and grace periods agree with the server."""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from pagedserve.server.cli import build_parser
from pagedserve.server.common.config import ServerConfig, parse_address

DEPLOY = Path(__file__).resolve().parents[2] / "config" / "deploy"
K8S_VERSION = "1.30"  # the oldest Kubernetes the manifests are meant for
PORTS = {"inference": 8080, "management": 8081, "metrics": 8082}


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def serve_args(argv: list[str]):
    """`pagedserve ARGV` parsed by the real CLI (a renamed flag fails here)."""
    args = build_parser().parse_args(argv)
    assert args.command == "serve"
    return args


def kserve_validator() -> jsonschema.Draft202012Validator:
    from importlib.resources import files

    import kubernetes_validate
    from referencing import Registry, Resource

    version = [v for v in kubernetes_validate.utils.all_versions() if v.startswith(K8S_VERSION)][-1]
    defs = files("kubernetes_validate") / "kubernetes-json-schema" / f"v{version}-local-strict" / "_definitions.json"
    definitions = Resource.from_contents(json.loads(defs.read_text()))
    schema = json.loads((DEPLOY / "schemas" / "kserve.schema.json").read_text())
    return jsonschema.Draft202012Validator(schema, registry=definitions @ Registry())


def test_kubernetes_manifests_validate():
    import kubernetes_validate

    resources = [d for p in sorted((DEPLOY / "kubernetes").glob("*.yaml")) for d in docs(p)]
    assert sorted(r["kind"] for r in resources) == ["Deployment", "Service"]
    for r in resources:
        kubernetes_validate.validate(r, K8S_VERSION, strict=True)
    broken = docs(DEPLOY / "kubernetes" / "deployment.yaml")[0]
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_kubernetes_probes_ports_and_drain():
    [deploy] = docs(DEPLOY / "kubernetes" / "deployment.yaml")
    [service] = docs(DEPLOY / "kubernetes" / "service.yaml")
    pod = deploy["spec"]["template"]["spec"]
    [c] = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == PORTS
    assert c["livenessProbe"]["httpGet"] == {"path": "/live", "port": "inference"}
    assert c["startupProbe"]["httpGet"] == {"path": "/live", "port": "inference"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "inference"}
    args = serve_args(c["args"])
    for api, port in PORTS.items():
        assert parse_address(getattr(args, f"{api}_address")) == ("0.0.0.0", port)
    assert args.vllm_metrics and args.models == ["default"]
    assert pod["terminationGracePeriodSeconds"] > ServerConfig().drain_grace
    assert deploy["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert {p["targetPort"]: p["port"] for p in service["spec"]["ports"]} == PORTS
    annotations = deploy["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(PORTS["metrics"])


def test_kserve_resources_validate():
    validator = kserve_validator()
    runtime = docs(DEPLOY / "kserve" / "servingruntime.yaml")[0]
    isvc = docs(DEPLOY / "kserve" / "inferenceservice.yaml")[0]
    for resource in (runtime, isvc):
        validator.validate(resource)
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    [c] = runtime["spec"]["containers"]
    args = serve_args(c["args"])
    assert args.model_store == "/mnt/models" and args.models == ["all"]  # KServe's mount point
    assert parse_address(args.inference_address)[1] == c["ports"][0]["containerPort"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    # The schema refuses what it should: a misspelt field, a core type's wrong field.
    bad = [
        dict(runtime, spec={**runtime["spec"], "supportedModelFormat": []}),
        dict(runtime, spec={**runtime["spec"], "containers": [{**c, "imagee": "x"}]}),
        dict(isvc, apiVersion="serving.kserve.io/v1alpha1"),
    ]
    for resource in bad:
        assert not validator.is_valid(resource)


@pytest.mark.skipif(not os.environ.get("KSERVE_CRD_DIR"), reason="KSERVE_CRD_DIR (KServe's config/crd/full) not given")
def test_kserve_resources_against_published_crds():
    """Optional: against KServe's own CRDs (the folder of serving.kserve.io_*.yaml)."""
    crds = Path(os.environ["KSERVE_CRD_DIR"])
    for manifest, crd in (
        ("servingruntime.yaml", "serving.kserve.io_servingruntimes.yaml"),
        ("inferenceservice.yaml", "serving.kserve.io_inferenceservices.yaml"),
    ):
        resource = docs(DEPLOY / "kserve" / manifest)[0]
        version = resource["apiVersion"].split("/")[1]
        [spec] = [v for v in docs(crds / crd)[0]["spec"]["versions"] if v["name"] == version]
        jsonschema.Draft7Validator(spec["schema"]["openAPIV3Schema"]).validate(resource)


def test_dockerfile():
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(path=str(DEPLOY / "Dockerfile"))
    assert parser.baseimage.startswith("python:3.")
    instructions = parser.structure
    repo = DEPLOY.parents[1]
    for ins in instructions:
        if ins["instruction"] == "COPY":
            *sources, _dest = ins["value"].split()
            for src in sources:
                assert (repo / src).exists(), src  # the build context is the repository root
    exposed = {int(p) for ins in instructions if ins["instruction"] == "EXPOSE" for p in ins["value"].split()}
    assert exposed == set(PORTS.values())
    [entry] = [json.loads(i["value"]) for i in instructions if i["instruction"] == "ENTRYPOINT"]
    [cmd] = [json.loads(i["value"]) for i in instructions if i["instruction"] == "CMD"]
    assert entry == ["pagedserve"]
    args = serve_args(cmd)
    assert args.models == ["default"] and args.model_store == "/opt/pagedserve/model_store"
    for api, port in PORTS.items():
        assert parse_address(getattr(args, f"{api}_address")) == ("0.0.0.0", port)
    [health] = [i["value"] for i in instructions if i["instruction"] == "HEALTHCHECK"]
    assert "127.0.0.1:8080/ping" in health
    [prepare] = [
        i["value"] for i in instructions if i["instruction"] == "RUN" and i["value"].startswith("pagedserve prepare")
    ]
    prepared = build_parser().parse_args(shlex.split(prepare)[1:])  # the first start's work
    assert prepared.command == "prepare" and prepared.model_store == args.model_store
    [torch] = re.findall(r'^\s*"(torch[<>=!~][^"]*)"', (repo / "pyproject.toml").read_text(), re.M)
    runs = " ".join(i["value"] for i in instructions if i["instruction"] == "RUN")
    assert f'pip install "{torch}" --index-url' in runs  # the CPU build, kept by the project's range


def test_systemd_unit():
    unit = configparser.ConfigParser(strict=True, interpolation=None)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read_string((DEPLOY / "systemd" / "pagedserve.service").read_text())
    assert unit.sections() == ["Unit", "Service", "Install"]
    service = unit["Service"]
    exec_start = shlex.split(service["ExecStart"])
    assert Path(exec_start[0]).is_absolute() and exec_start[0].endswith("/bin/pagedserve")
    args = serve_args(exec_start[1:])
    assert args.models == ["default"] and args.model_store.startswith("/var/lib/pagedserve")
    assert service["Type"] in {"simple", "exec"} and service["KillSignal"] == "SIGTERM"
    assert float(service["TimeoutStopSec"]) > ServerConfig().drain_grace
    assert service["WorkingDirectory"] == "/var/lib/pagedserve" and service["StateDirectory"] == "pagedserve"
    assert service["Environment"] == "PAGEDSERVE_CACHE_DIR=/var/cache/pagedserve"
    assert service["CacheDirectory"] == "pagedserve"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
