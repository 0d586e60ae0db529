"""deploy/ checked without a cluster, Docker or a network.

A manifest that `kubectl apply -k deploy/k8s` or `docker compose up` would refuse, or that they
would accept while it cannot work (a probe on a port nobody serves, a topic the worker does not
read, a mounted file that does not exist, an alert on a metric nobody exports), fails here, in
CI, instead of on the first deployment. Each tool checks one file; most of what breaks a
deployment is a name that one file gives and another expects, so those are checked here too.

Not checked here: PromQL beyond bracket balance (nothing in the environment parses it), whether
the image tags exist, whether the stack starts. tests/integration/test_dashboard_metrics.py
checks the names the dashboard and the alerts use against a real worker's /metrics.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from check_jsonschema.builtin_schemas import get_builtin_schema
from yamllint import linter
from yamllint.config import YamlLintConfig

from mmworker.config import KafkaConfig, WorkerConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SCHEMAS = DEPLOY / "schemas"
COMPOSE = DEPLOY / "compose.yaml"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
DASHBOARD = DEPLOY / "grafana" / "mmworker.json"

#: The version the manifests target (a current managed-cluster default), and the newest that
#: kubernetes-validate ships schemas for, so an API removed since then shows up on an upgrade.
K8S_VERSIONS = ("1.33.0", kubernetes_validate.latest_version())

#: Kinds whose CRDs kubernetes-validate does not know: checked against deploy/schemas/.
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): "triggerauthentication",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor",
}

#: Every metric the worker exports (mmworker/metrics.py), by type. The dashboard and the alert
#: rules may name no other; the integration test checks a real worker exports these names.
EXPORTED = {
    "mmworker_jobs_total": "counter",
    "mmworker_failures_total": "counter",
    "mmworker_retries_total": "counter",
    "mmworker_commits_total": "counter",
    "mmworker_commit_errors_total": "counter",
    "mmworker_feature_cache_total": "counter",
    "mmworker_suspect_jobs_total": "counter",
    "mmworker_output_tokens_total": "counter",
    "mmworker_engine_preemptions_total": "counter",
    "mmworker_in_flight": "gauge",
    "mmworker_paused": "gauge",
    "mmworker_ready": "gauge",
    "mmworker_consumer_lag_messages": "gauge",
    "mmworker_engine_requests_running": "gauge",
    "mmworker_engine_requests_waiting": "gauge",
    "mmworker_engine_kv_cache_usage_ratio": "gauge",
    "mmworker_feature_cache_bytes": "gauge",
    "mmworker_encoder_store_bytes": "gauge",
    "mmworker_process_resident_memory_bytes": "gauge",
    "mmworker_last_commit_timestamp_seconds": "gauge",
    "mmworker_start_time_seconds": "gauge",
    "mmworker_engine_busy_seconds": "gauge",
    "mmworker_stage_seconds": "histogram",
    "mmworker_queue_wait_seconds": "histogram",
    "mmworker_end_to_end_seconds": "histogram",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

#: What the dashboard must show (issue #15): a panel that loses its query fails here.
ON_DASHBOARD = {
    "mmworker_jobs_total",
    "mmworker_end_to_end_seconds_bucket",
    "mmworker_queue_wait_seconds_bucket",
    "mmworker_consumer_lag_messages",
    "mmworker_failures_total",
    "mmworker_engine_requests_running",
    "mmworker_engine_requests_waiting",
    "mmworker_engine_kv_cache_usage_ratio",
    "mmworker_engine_preemptions_total",
    "mmworker_feature_cache_total",
    "mmworker_feature_cache_bytes",
    "mmworker_encoder_store_bytes",
    "mmworker_process_resident_memory_bytes",
    "mmworker_ready",
}

_METRIC = re.compile(r"(?<![A-Za-z0-9_:])mmworker_[a-z0-9_]+")
_DURATION = re.compile(
    r"^(0|([0-9]+y)?([0-9]+w)?([0-9]+d)?([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?)$"
)


def _yaml_docs(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _k8s_objects() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            for doc in _yaml_docs(path):
                yield path.name, doc


def _one(kind: str) -> dict[str, Any]:
    (found,) = [doc for _, doc in _k8s_objects() if doc["kind"] == kind]
    return found


def _schema_errors(schema: dict[str, Any], doc: Any) -> list[str]:
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.path)))
    ]


def _crd_schema(doc: dict[str, Any]) -> dict[str, Any]:
    name = CRD_SCHEMAS[(doc["apiVersion"], doc["kind"])]
    schema: dict[str, Any] = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    return schema


@pytest.fixture
def cfg(monkeypatch: pytest.MonkeyPatch) -> WorkerConfig:
    """The config the Deployment mounts, loaded by the worker's own loader, with the password
    the Secret provides and nothing from this shell's MMWORKER_* variables."""
    _clear_mmworker_env(monkeypatch)
    monkeypatch.setenv("MMWORKER_KAFKA__SASL_PASSWORD", "from-the-secret")
    return load_config(K8S / "mmworker.toml")


def _clear_mmworker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("MMWORKER_")]:
        monkeypatch.delenv(key)


def _seconds(duration: str) -> float:
    """Compose/Prometheus durations such as 90s, 15m, 1h30m."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    parts = re.findall(r"(\d+)(ms|s|m|h|d)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(int(n) * units[u] for n, u in parts)


def _container() -> dict[str, Any]:
    (container,) = _one("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def _compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return doc


def _compose_topics() -> dict[str, tuple[int, str]]:
    """topic -> (partitions, the rest of its line) from the `topics` service's script."""
    script = "\n".join(_compose()["services"]["topics"]["command"])
    found = {}
    for line in script.splitlines():
        m = re.match(r"\s*create --topic (\S+) --partitions (\d+)(.*)$", line)
        if m:
            found[m[1]] = (int(m[2]), m[3])
    return found


def _mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Bind mounts of a compose service: target in the container -> source on this machine."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            out[target] = (DEPLOY / source).resolve()
    return out


def referenced_metric_names() -> dict[str, set[str]]:
    """mmworker_* names as written in the dashboard's queries and in the alert expressions.

    Shared with the integration test, which looks each one up in a real worker's scrape.
    """
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            queries.append(query["query"] if isinstance(query, dict) else query)
            queries.append(variable.get("definition", ""))
    alerts = [rule["expr"] for rule in _rules(yaml.safe_load(ALERTS.read_text())["groups"])]
    return {
        "dashboard": {n for q in queries for n in _METRIC.findall(q)},
        "alerts": {n for e in alerts for n in _METRIC.findall(e)},
    }


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def _rules(groups: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for group in groups:
        yield from group["rules"]


def _is_exported(name: str) -> bool:
    if EXPORTED.get(name) in ("counter", "gauge"):
        return True
    return any(
        name.endswith(suffix) and EXPORTED.get(name.removesuffix(suffix)) == "histogram"
        for suffix in HISTOGRAM_SUFFIXES
    )


# --- Kubernetes ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_manifests_validate_strictly(version: str) -> None:
    """Strict: an unknown field is an error, as with `kubectl apply --validate=strict`, where a
    lenient apply would drop a misspelt probe field and deploy a pod without that probe."""
    checked = []
    for name, doc in _k8s_objects():
        if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS:
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(map(str, exc.path))
            pytest.fail(f"{name} ({doc['kind']}) at {path}: {exc.message}")
        checked.append(doc["kind"])
    assert sorted(checked) == ["Deployment", "PodDisruptionBudget", "Service"]


def test_crd_manifests_match_their_schemas() -> None:
    """KEDA's and the Prometheus Operator's CRDs are not in kubernetes-validate; the API server
    would prune a misspelt field of theirs silently (structural schemas), so a closed schema of
    the fields we use stands in."""
    kinds = []
    for name, doc in _k8s_objects():
        if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS:
            assert not (errors := _schema_errors(_crd_schema(doc), doc)), f"{name}: {errors}"
            kinds.append(doc["kind"])
    assert sorted(kinds) == sorted(kind for _, kind in CRD_SCHEMAS)


@pytest.mark.parametrize(
    ("what", "mutate"),
    [
        (
            "probe field misspelt",
            lambda d: d["spec"]["template"]["spec"]["containers"][0]["startupProbe"].update(
                periodSecond=10
            ),
        ),
        (
            "port as a string",
            lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(
                containerPort="9400"
            ),
        ),
    ],
)
def test_strict_validation_refuses_a_broken_deployment(what: str, mutate: Any) -> None:
    """The validators must be able to say no: a schema set that accepts anything would make
    the tests above pass on any manifest."""
    doc = copy.deepcopy(_one("Deployment"))
    mutate(doc)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


@pytest.mark.parametrize(
    ("kind", "mutate"),
    [
        (
            "ScaledObject",
            lambda d: d["spec"]["triggers"][0]["metadata"].update(allowIdleConsumers=False),
        ),
        ("ScaledObject", lambda d: d["spec"]["triggers"][0]["metadata"].update(lagTreshold="5")),
        ("ScaledObject", lambda d: d["spec"].update(maxReplicas=6)),
        (
            "TriggerAuthentication",
            lambda d: d["spec"]["secretTargetRef"][0].update(parameter="user"),
        ),
        (
            "PrometheusRule",
            lambda d: d["spec"]["groups"][0]["rules"][0].update(**{"for": "10 minutes"}),
        ),
        ("PrometheusRule", lambda d: d["spec"]["groups"][0]["rules"][0].update(record="x")),
        ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].update(intervall="15s")),
    ],
)
def test_crd_schemas_refuse_mistakes(kind: str, mutate: Any) -> None:
    """Mistakes the real CRDs refuse or silently drop: an unquoted boolean in trigger metadata
    (a map of strings), a misspelt key, a duration Prometheus cannot parse, a rule that is both
    an alert and a recording rule."""
    doc = copy.deepcopy(_one(kind))
    assert not _schema_errors(_crd_schema(doc), doc)
    mutate(doc)
    assert _schema_errors(_crd_schema(doc), doc)


def test_kustomization_lists_every_manifest() -> None:
    """A manifest left out of `resources` is never applied, and nothing else would notice."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    schema = json.loads((SCHEMAS / "kustomization.schema.json").read_text())
    assert not (errors := _schema_errors(schema, kustomization)), errors
    manifests = {
        path.name
        for path in K8S.glob("*.y*ml")
        if path.name != "kustomization.yaml"
        and any(isinstance(d, dict) and "apiVersion" in d and "kind" in d for d in _yaml_docs(path))
    }
    listed = kustomization["resources"]
    assert sorted(listed) == sorted(manifests), "kustomization.yaml resources vs deploy/k8s"
    generated = [f for gen in kustomization.get("configMapGenerator", []) for f in gen["files"]]
    for name in [*listed, *generated]:
        assert (K8S / name).is_file(), name
    assert generated == ["mmworker.toml"]


def test_mounted_config_is_the_example_and_loads(cfg: WorkerConfig) -> None:
    """Kustomize reads no file outside deploy/k8s, so the ConfigMap's source is a copy of
    deploy/mmworker.example.toml (the one the README documents); the two must not drift, and
    the worker's own loader must accept it."""
    assert (K8S / "mmworker.toml").read_bytes() == (DEPLOY / "mmworker.example.toml").read_bytes()
    assert cfg.metrics_port is not None and cfg.processes >= 1


def test_pod_serves_the_probes_and_ports_it_declares(cfg: WorkerConfig) -> None:
    """Probes and scrapes go to one named port, metrics_port: the worker's, or under
    `processes > 1` the supervisor's, which answers for every process."""
    assert cfg.metrics_port is not None
    container = _container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": cfg.metrics_port}
    assert all(len(name) <= 15 for name in ports)
    for probe, path in (
        ("startupProbe", "/startupz"),
        ("livenessProbe", "/livez"),
        ("readinessProbe", "/readyz"),
    ):
        assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}, probe
    spec = _one("Deployment")["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] > cfg.limits.shutdown_grace_s
    assert container["args"] == ["run", "--config", "/etc/mmworker/mmworker.toml"]
    assert "replicas" not in _one("Deployment")["spec"], "KEDA owns the replica count"


def test_startup_budget_fits_the_not_ready_alert() -> None:
    """A model load may take the startup probe's whole budget; the not-ready alert must wait
    longer, or every slow start pages someone."""
    probe = _container()["startupProbe"]
    budget = probe["periodSeconds"] * probe["failureThreshold"]
    assert budget >= 15 * 60, "sized for a 3B/7B model load"
    (not_ready,) = [
        r
        for r in _rules(_one("PrometheusRule")["spec"]["groups"])
        if r["alert"] == "MmworkerNotReady"
    ]
    assert _seconds(not_ready["for"]) > budget


def test_objects_select_and_name_each_other(cfg: WorkerConfig) -> None:
    """Selectors, port names, Secret, ConfigMap and target names that link the objects: a
    mismatch applies cleanly and does nothing (a Service with no endpoints, a PDB guarding no
    pod, an autoscaler for another Deployment)."""
    deployment = _one("Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    service, pdb, monitor = _one("Service"), _one("PodDisruptionBudget"), _one("ServiceMonitor")
    for selector in (service["spec"]["selector"], pdb["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= pod_labels.items()
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    container_ports = {p["name"] for p in _container()["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == container_ports
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {
        p["name"] for p in service["spec"]["ports"]
    }

    scaled, auth = _one("ScaledObject"), _one("TriggerAuthentication")
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    secrets = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for e in _container()["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert {ref["name"] for ref in auth["spec"]["secretTargetRef"]} == secrets

    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    sources = volumes["config"]["projected"]["sources"]
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert [s["configMap"]["name"] for s in sources if "configMap" in s] == [
        kustomization["configMapGenerator"][0]["name"]
    ]
    ca = [i["path"] for s in sources if "secret" in s for i in s["secret"]["items"]]
    assert cfg.kafka.ssl_cafile == Path("/etc/mmworker") / ca[0]
    assert {s["secret"]["name"] for s in sources if "secret" in s} == secrets


def test_autoscaler_reads_the_workers_group_and_stays_within_the_partitions(
    cfg: WorkerConfig,
) -> None:
    """KEDA must measure the lag of the group and topic the worker consumes, over the same
    connection settings; more consumers than partitions sit idle, and each pod runs
    `processes` consumers, which KEDA's own cap does not know."""
    scaled = _one("ScaledObject")
    (trigger,) = scaled["spec"]["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "kafka"
    assert meta["bootstrapServers"] == cfg.kafka.bootstrap_servers
    assert meta["consumerGroup"] == cfg.kafka.group_id
    assert meta["topic"] == cfg.kafka.input_topic
    assert meta["allowIdleConsumers"] == "false"
    assert meta["tls"] == ("enable" if cfg.kafka.security_protocol.endswith("SSL") else "disable")
    assert cfg.kafka.sasl_mechanism is not None
    keda_sasl = {
        "PLAIN": "plaintext",
        "SCRAM-SHA-256": "scram_sha256",
        "SCRAM-SHA-512": "scram_sha512",
    }
    assert meta["sasl"] == keda_sasl[cfg.kafka.sasl_mechanism]
    partitions = _compose_topics()[cfg.kafka.input_topic][0]
    assert scaled["spec"]["maxReplicaCount"] * cfg.processes <= partitions
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    # In-flight jobs are uncommitted lag: a lower target would scale on work already in hand.
    assert int(meta["lagThreshold"]) >= cfg.processes * cfg.limits.max_in_flight


@pytest.mark.skipif(
    not (shutil.which("kustomize") or shutil.which("kubectl")), reason="no kustomize or kubectl"
)
def test_kustomize_builds_the_base() -> None:
    """Where Kustomize is installed: the base builds, and the generated ConfigMap's hashed name
    reaches the projected volume (Kustomize rewrites names only in fields it knows)."""
    cmd = ["kustomize", "build"] if shutil.which("kustomize") else ["kubectl", "kustomize"]
    out = subprocess.run([*cmd, str(K8S)], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert configmap["data"]["mmworker.toml"] == (K8S / "mmworker.toml").read_text()
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    sources = deployment["spec"]["template"]["spec"]["volumes"][0]["projected"]["sources"]
    assert {"configMap": {"name": configmap["metadata"]["name"]}} in sources
    assert len(docs) == len(list(_k8s_objects())) + 1


# --- YAML ---------------------------------------------------------------------------------


def test_yamllint_passes_on_every_yaml_file() -> None:
    """yamllint catches what PyYAML and the tools accept silently: a duplicated key (the last
    one wins), and tabs or odd indentation that change the structure."""
    conf = YamlLintConfig(file=str(DEPLOY / ".yamllint"))
    files = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml"), DEPLOY / ".yamllint"])
    assert {COMPOSE, ALERTS, K8S / "kustomization.yaml"} <= set(files)
    problems = [
        f"{path.relative_to(ROOT)}:{p.line}:{p.column} {p.level} {p.desc} ({p.rule})"
        for path in files
        for p in linter.run(path.read_text(), conf, str(path))
    ]
    assert not problems, "\n".join(problems)


# --- Compose ------------------------------------------------------------------------------


def test_compose_validates_against_the_compose_spec() -> None:
    """The compose-spec JSON Schema that check-jsonschema vendors (what `docker compose config`
    validates against), closed to unknown keys."""
    schema = get_builtin_schema("vendor.compose-spec")
    assert not (errors := _schema_errors(schema, _compose())), errors
    broken = _compose()
    broken["services"]["worker"]["healthchek"] = broken["services"]["worker"].pop("healthcheck")
    assert _schema_errors(schema, broken), "the schema must refuse a misspelt key"


def test_compose_creates_the_topics_the_worker_uses() -> None:
    """The worker's default topics (the compose worker sets none), with the suspects topic
    compacted as the worker requires."""
    topics = _compose_topics()
    defaults = KafkaConfig()  # type: ignore[call-arg]
    names = [
        defaults.input_topic,
        defaults.output_topic,
        defaults.dead_letter_topic,
        defaults.suspects_topic,
    ]
    assert sorted(topics) == sorted(names)
    assert topics[defaults.input_topic][0] == 12
    assert "cleanup.policy=compact" in topics[defaults.suspects_topic][1]
    kafka = _compose()["services"]["kafka"]["environment"]
    assert kafka["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"


def test_compose_worker_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's environment is a valid configuration for the worker's own loader, reaches
    the broker on its advertised in-network listener, and the healthcheck, the stop grace and
    the GPU reservation fit it."""
    services = _compose()["services"]
    worker = services["worker"]
    env = worker["environment"]
    _clear_mmworker_env(monkeypatch)
    for key, value in env.items():
        # ${VAR:-default} is compose interpolation: the default is what runs unless VAR is set.
        monkeypatch.setenv(key, re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value)))
    cfg = load_config()
    assert cfg.logging.format == "json"
    assert cfg.metrics_port == 9400 and cfg.processes == 1

    listeners = dict(
        entry.split("://")
        for entry in services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"].split(",")
    )
    assert cfg.kafka.bootstrap_servers == listeners["INTERNAL"]
    assert cfg.kafka.bootstrap_servers.split(":")[0] in services

    assert worker["depends_on"] == {"topics": {"condition": "service_completed_successfully"}}
    assert services["topics"]["depends_on"] == {"kafka": {"condition": "service_healthy"}}
    probe = " ".join(worker["healthcheck"]["test"])
    assert f"http://localhost:{cfg.metrics_port}/readyz" in probe
    assert _seconds(worker["healthcheck"]["start_period"]) >= 15 * 60
    assert _seconds(worker["stop_grace_period"]) > cfg.limits.shutdown_grace_s
    (gpu,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert gpu == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    assert worker["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"}
    assert (DEPLOY / worker["build"]["context"] / worker["build"]["dockerfile"]).is_file()


def test_compose_mounts_and_addresses_resolve() -> None:
    """Every file a container is given exists, Prometheus loads the rules file compose mounts
    and scrapes the worker where it serves, and Grafana's data source and dashboard directory
    are the ones compose provides."""
    services = _compose()["services"]
    for name, service in services.items():
        for target, source in _mounts(service).items():
            assert source.exists(), f"{name}: {source} (for {target}) does not exist"

    prom_mounts = _mounts(services["prometheus"])
    config = yaml.safe_load(prom_mounts["/etc/prometheus/prometheus.yml"].read_text())
    for rule_file in config["rule_files"]:
        target = str(Path("/etc/prometheus") / rule_file)
        assert prom_mounts[target] == ALERTS.resolve(), rule_file
    (job,) = config["scrape_configs"]
    (static,) = job["static_configs"]
    port = services["worker"]["environment"]["MMWORKER_METRICS_PORT"]
    assert static["targets"] == [f"worker:{port}"]
    assert f"{port}:{port}" in services["worker"]["ports"]

    grafana = services["grafana"]
    graf_mounts = _mounts(grafana)
    provisioning = graf_mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())[
        "datasources"
    ]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "mmworker.yaml").read_text())[
        "providers"
    ]
    dashboards = [t for t, s in graf_mounts.items() if s == DASHBOARD.resolve()]
    assert [str(Path(t).parent) for t in dashboards] == [provider["options"]["path"]]
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == dashboards[0]


def _image_env() -> dict[str, str]:
    """The Dockerfile's ENV settings (KEY=VALUE form, lines joined at backslashes)."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    env = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(item.split("=", 1) for item in line[4:].split())
    return env


@pytest.mark.parametrize("var", ["VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"])
def test_compile_caches_live_on_a_mounted_volume(var: str) -> None:
    """Outside a volume, torch.compile's caches die with the container and every restart
    compiles the model again (minutes on a GPU): in Kubernetes and in compose alike, the image's
    cache directories lie under a volume the worker mounts."""
    path = Path(_image_env()[var])
    k8s = [m["mountPath"] for m in _container()["volumeMounts"] if not m.get("readOnly")]
    compose = [v.split(":")[1] for v in _compose()["services"]["worker"]["volumes"]]
    for mounts in (k8s, compose):
        assert any(path.is_relative_to(m) for m in mounts), (var, path, mounts)


# --- Alert rules --------------------------------------------------------------------------


def _balanced(expr: str) -> bool:
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for ch in re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr):  # brackets inside strings do not count
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack


def test_alert_rules_are_complete() -> None:
    """Every alert says how long, how bad and what happened: `for` keeps a blip from paging,
    severity routes it, the summary is what a pager shows."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    rules = list(_rules(groups))
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)), names
    assert sorted(names) == sorted(
        [
            "MmworkerDeadLetterRateHigh",
            "MmworkerCommitsStalled",
            "MmworkerConsumerLagGrowing",
            "MmworkerRestarted",
            "MmworkerNotReady",
        ]
    )
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert _DURATION.match(rule["for"]), rule
        assert rule["labels"]["severity"] in ("warning", "critical"), rule
        assert rule["annotations"]["summary"].strip(), rule
        assert _balanced(rule["expr"]), f"{rule['alert']}: unbalanced brackets"
    restarted = next(r for r in rules if r["alert"] == "MmworkerRestarted")
    assert f'container="{_container()["name"]}"' in restarted["expr"]


def test_alert_rules_are_the_same_in_compose_and_kubernetes() -> None:
    """Two copies of the rules (plain file for compose, PrometheusRule for the operator): an
    alert fixed in one only would behave differently in the other."""
    plain = yaml.safe_load(ALERTS.read_text())["groups"]
    operator = _one("PrometheusRule")["spec"]["groups"]
    by_name = [{r["alert"]: r for r in _rules(groups)} for groups in (plain, operator)]
    differ = sorted(
        name
        for name in by_name[0].keys() | by_name[1].keys()
        if by_name[0].get(name) != by_name[1].get(name)
    )
    assert not differ, f"alerts.yaml and prometheusrule.yaml differ on {differ}"
    assert operator == plain, "same rules, different groups"


def test_alert_rules_name_only_exported_metrics() -> None:
    """An expression on a metric that does not exist is never true: the alert would be silent."""
    unknown = {n for n in referenced_metric_names()["alerts"] if not _is_exported(n)}
    assert not unknown, sorted(unknown)


def test_histogram_base_name_is_not_a_series() -> None:
    """The rule the name checks rely on: a histogram is queried by its _bucket/_sum/_count."""
    assert _is_exported("mmworker_end_to_end_seconds_bucket")
    assert not _is_exported("mmworker_end_to_end_seconds")
    assert not _is_exported("mmworker_jobs_total_bucket")
    assert _METRIC.findall('rate(mmworker_jobs_total{topic="mmworker.jobs"}[5m])') == [
        "mmworker_jobs_total"
    ]


# --- Dashboard ----------------------------------------------------------------------------


def test_dashboard_queries_name_only_exported_metrics() -> None:
    """A query on a misspelt metric draws an empty panel, which looks like 'nothing happened'."""
    names = referenced_metric_names()["dashboard"]
    unknown = {n for n in names if not _is_exported(n)}
    assert not unknown, sorted(unknown)
    assert not (missing := ON_DASHBOARD - names), f"no panel queries {sorted(missing)}"


def test_dashboard_uses_its_datasource_variable_and_a_clean_grid() -> None:
    """Every query goes through the `datasource` variable, so the dashboard imports into any
    Grafana whatever its Prometheus is called; panels do not overlap."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ds = {"type": "prometheus", "uid": "${datasource}"}
    panels = list(_panels(dashboard))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == ds, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == ds, panel["title"]
            assert _balanced(target["expr"]), f"{panel['title']}: {target['expr']}"
