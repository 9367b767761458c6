"""The container stage: build the image from the Dockerfile with podman, start the server in it
with a tiny model mounted in, and talk to it from the host.

How podman and buildah work on these machines (no Docker engine, no image registry, chroot
isolation, a bootstrapped Debian base, the CPU torch wheel from this disk) is described in
shared/CONTAINERS.md; .ci/container.sh installs the tools and runs this file:

    pytest -m container -p no:cacheprovider -s tests/deploy/test_container.py

Takes minutes cold (torch alone is large); podman's layer cache makes a rebuild after a source
change take well under a minute.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server_util import free_port

ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGE = os.environ.get("STREAMSD_CI_BASE_IMAGE", "localhost/debian:bookworm-min")
IMAGE = os.environ.get("STREAMSD_CI_IMAGE", "localhost/streamsd:ci")
DEBIAN_MIRROR = "http://deb.debian.org/debian"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.container,
    # A cold build downloads and installs torch and friends inside the image.
    pytest.mark.timeout(3000),
]


def log(msg: str) -> None:
    print(f"[container] {msg}", flush=True)


def run(*cmd: str, check: bool = True, timeout: float | None = 300, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


# buildah's chroot runtime re-executes itself from a sealed memfd copy of its binary; now and
# then sealing fails with EBUSY ("Close_Fd sealing memfd copy: Device or resource busy", seen
# about once in twenty runs here) before anything of ours has run. Such a start is retried.
BUILDAH_FLAKE = "sealing memfd copy"


def buildah_run(container: str, *cmd: str) -> subprocess.CompletedProcess:
    for attempt in range(3):
        proc = run("buildah", "run", "--isolation=chroot", "--network=host", container, "--", *cmd,
                   check=False)
        if proc.returncode == 0 or BUILDAH_FLAKE not in proc.stderr:
            break
        log(f"buildah run hit its memfd race (attempt {attempt + 1}); retrying")
        time.sleep(1)
    if proc.returncode != 0:
        pytest.fail(f"buildah run {' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tools() -> None:
    missing = [t for t in ("podman", "buildah") if shutil.which(t) is None]
    if missing:
        msg = f"{', '.join(missing)} not installed (.ci/container.sh installs them)"
        # In the CI stage a skip would pass silently; there the tools are a requirement.
        if os.environ.get("STREAMSD_CONTAINER_REQUIRED"):
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="module")
def base_image(tools) -> str:
    """The local Debian base (no image registry is reachable). .ci/container.sh normally
    made it already; podman's image store keeps it between runs on the same machine."""
    if run("podman", "image", "exists", BASE_IMAGE, check=False).returncode == 0:
        return BASE_IMAGE
    if shutil.which("debootstrap") is None:
        pytest.fail(f"{BASE_IMAGE} is missing and debootstrap is not installed")
    rootfs = Path(tempfile.mkdtemp(prefix="streamsd-rootfs-"))
    try:
        t0 = time.monotonic()
        run("debootstrap", "--variant=minbase", "bookworm", str(rootfs), DEBIAN_MIRROR, timeout=900)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        run("podman", "import", "-", BASE_IMAGE, stdin=tar.stdout)
        tar.wait()
        log(f"bootstrapped {BASE_IMAGE} in {time.monotonic() - t0:.0f} s")
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
    return BASE_IMAGE


def _pip_setting(name: str) -> str | None:
    """A pip setting as this machine's pip sees it (environment first, then config files)."""
    env = os.environ.get("PIP_" + name.upper().replace("-", "_"))
    if env:
        return env
    out = run(sys.executable, "-m", "pip", "config", "list", check=False).stdout
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.split(".")[-1] == name:
            return value.strip().strip("'\"")
    return None


@pytest.fixture(scope="module")
def pip_mounts(tmp_path_factory) -> list[str]:
    """Build-time mounts that point the image's pip at this machine's certificate authority and
    at the CPU torch wheel on this disk. They exist only during the build: the Dockerfile
    itself stays standard."""
    cert = _pip_setting("cert") or "/etc/ssl/certs/ca-certificates.crt"
    find_links = _pip_setting("find-links")
    wheels = sorted(glob.glob(os.path.join(find_links or "/nonexistent", "torch-*+cpu-cp311-*.whl")))
    if not wheels:
        pytest.fail(f"no CPU torch wheel for Python 3.11 under find-links {find_links!r}; "
                    "the image build would download the multi-GB CUDA torch")
    # torch-2.13.0+cpu-cp311-... -> 2.13.0+cpu
    torch_version = Path(wheels[-1]).name.split("-")[1]
    d = tmp_path_factory.mktemp("pip")
    (d / "pip.conf").write_text(
        "[global]\ncert = /etc/pip-ca.crt\nfind-links = /wheels\nconstraint = /etc/pip-constraints.txt\n"
    )
    (d / "constraints.txt").write_text(f"torch=={torch_version}\n")
    log(f"torch {torch_version} from {find_links}, CA bundle {cert}")
    return [
        "-v", f"{cert}:/etc/pip-ca.crt:ro",
        "-v", f"{d / 'pip.conf'}:/etc/pip.conf:ro",
        "-v", f"{d / 'constraints.txt'}:/etc/pip-constraints.txt:ro",
        "-v", f"{find_links}:/wheels:ro",
    ]


def inspect(image: str, fmt: str) -> str:
    return run("podman", "image", "inspect", "--format", fmt, image).stdout.strip()


def build(tag: str, base_image: str, pip_mounts: list[str], *build_args: str) -> str:
    cmd = [
        "podman", "build",
        # The default OCI runtime fails on this kernel's cgroups; chroot isolation works.
        "--isolation=chroot", "--network=host",
        # Docker format: the OCI image format has no HEALTHCHECK and podman would drop it.
        "--format", "docker",
        "--build-arg", f"BASE_IMAGE={base_image}",
        *[a for arg in build_args for a in ("--build-arg", arg)],
        *pip_mounts,
        "-f", str(ROOT / "Dockerfile"),
        "-t", tag,
        str(ROOT),
    ]
    t0 = time.monotonic()
    for _ in range(2):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=2700)
        # RUN steps go through the same chroot runtime; the layers done so far are cached.
        if proc.returncode == 0 or BUILDAH_FLAKE not in proc.stdout + proc.stderr:
            break
        log("a RUN step hit buildah's memfd race; building again")
    elapsed = time.monotonic() - t0
    if proc.returncode != 0:
        pytest.fail(f"podman build failed after {elapsed:.0f} s:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")
    cached = proc.stdout.count("Using cache")
    size = int(inspect(tag, "{{.Size}}"))
    log(f"built {tag} from {base_image}{''.join(' ' + a for a in build_args)} in {elapsed:.1f} s ({cached} steps from cache)")
    log(f"image size {size} bytes ({size / 1e9:.2f} GB)")
    return tag


@pytest.fixture(scope="module")
def image(base_image, pip_mounts) -> str:
    return build(IMAGE, base_image, pip_mounts)


@pytest.fixture(scope="module")
def tiny_models() -> Iterator[Path]:
    """Target and draft written to a world-readable directory: the image's uid 10001 must read
    them through the bind mount (pytest's tmp dirs are 0700)."""
    from tests.tiny import build_model, build_tokenizer

    d = Path(tempfile.mkdtemp(prefix="streamsd-ctr-models-"))
    try:
        tok = build_tokenizer()
        build_model(d / "target", seed=0, tokenizer=tok, weight_scale=4.0)
        build_model(d / "draft", seed=1, tokenizer=tok, layers=1, hidden=32, heads=2, kv_heads=1,
                    intermediate=64, weight_scale=4.0)
        for p in [d, *d.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def container_of(image: str) -> Iterator[str]:
    name = f"streamsd-ci-{os.getpid()}-{time.monotonic_ns()}"
    run("buildah", "from", "--pull=never", "--name", name, image)
    try:
        yield name
    finally:
        run("buildah", "rm", name, check=False)


@pytest.fixture
def working_container(image) -> Iterator[str]:
    with container_of(image) as name:
        yield name


def _server_pids(pgid: int) -> list[int]:
    """The processes of the command run by `buildah run` (not buildah's own helpers, whose
    names contain 'buildah') in the process group we started it in."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) == pgid and "buildah" not in (entry / "comm").read_text():
                pids.append(int(entry.name))
        except (OSError, ProcessLookupError):
            continue  # exited meanwhile
    return pids


def _stop(proc: subprocess.Popen, grace: float = 40) -> bool:
    """Stop the server as `docker stop` would: SIGTERM to the server itself (buildah's chroot
    helper answers a SIGTERM by SIGKILLing its child, which would skip the drain), SIGKILL to
    the whole group only if it does not exit within `grace`. True if it stopped gracefully."""
    if proc.poll() is not None:
        return True
    for pid in _server_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        proc.wait(grace)
        return True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        return False


# ------------------------------------------------------------------ tests


def test_image_user_is_not_root(image, working_container):
    user = inspect(image, "{{.Config.User}}")
    log(f"Config.User = {user!r}")
    assert user and user.split(":")[0] not in ("root", "0")

    uid = buildah_run(working_container, "id", "-u")
    log(f"id -u inside = {uid.stdout.strip()}")
    assert int(uid.stdout.strip()) != 0

    # The metadata the Dockerfile promises survived the build.
    assert json.loads(inspect(image, "{{json .Config.Entrypoint}}")) == ["streamsd", "serve", "--host", "0.0.0.0"]
    assert "8000/tcp" in json.loads(inspect(image, "{{json .Config.ExposedPorts}}"))
    assert "/models" in json.loads(inspect(image, "{{json .Config.Volumes}}"))
    health = inspect(image, "{{json .Config.Healthcheck}}")
    log(f"Healthcheck = {health}")
    assert "/health" in health


@contextlib.contextmanager
def serving(image: str, container: str, flags: list[str], log_path: Path,
            mounts: tuple[str, ...] = ()) -> Iterator[httpx.Client]:
    """Run the image's entrypoint plus `flags` (what a user appends after the image name in
    `docker run`) in `container`, wait for /health 200, yield a client for it, then stop it
    the way `docker stop` does and check that it drained and exited cleanly."""
    port = free_port()
    # `buildah run` ignores ENTRYPOINT, so run the image's own one.
    entrypoint = json.loads(inspect(image, "{{json .Config.Entrypoint}}"))
    cmd = ["buildah", "run", "--isolation=chroot", "--network=host",
           *[a for m in mounts for a in ("-v", m)], container, "--",
           *entrypoint, "--port", str(port), *flags]
    log("starting: " + " ".join(cmd))

    def start() -> subprocess.Popen:
        with open(log_path, "wb") as out:
            # Own process group, so that nothing it starts can outlive the test.
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    proc, retries = start(), 2
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            t0, status = time.monotonic(), None
            while time.monotonic() - t0 < 300:
                if proc.poll() is not None:
                    if retries and BUILDAH_FLAKE in log_path.read_text(errors="replace"):
                        log("buildah run hit its memfd race; restarting the server")
                        proc, retries = start(), retries - 1
                        continue
                    pytest.fail(f"server exited {proc.returncode}:\n{log_path.read_text()[-4000:]}")
                try:
                    r = client.get("/health", timeout=5)
                    status = r.status_code
                    if status == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(1)
            else:
                pytest.fail(f"/health not 200 after 300 s (last {status}):\n{log_path.read_text()[-4000:]}")
            log(f"/health 200 {r.json()} after {time.monotonic() - t0:.1f} s")
            assert r.json()["status"] == "ok"
            yield client
    finally:
        t0 = time.monotonic()
        graceful = _stop(proc)
        log(f"server stopped in {time.monotonic() - t0:.1f} s (exit {proc.returncode}, "
            f"{'SIGTERM' if graceful else 'SIGKILL'}); last log lines:\n"
            + "\n".join(log_path.read_text(errors="replace").splitlines()[-6:]))
    # SIGTERM drains and exits cleanly, and nothing is left listening on the port.
    assert graceful and proc.returncode == 0
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0


def test_server_in_image_serves_health_and_sse(image, working_container, tiny_models, tmp_path):
    flags = ["--model", "/srv/models/target", "--draft-model", "/srv/models/draft",
             "--speculative-method", "draft", "--speculation-policy", "fixed", "--device", "cpu",
             "--drain-timeout", "5"]
    with serving(image, working_container, flags, tmp_path / "server.log",
                 mounts=(f"{tiny_models}:/srv/models:ro",)) as client:
        # The web UI ships in the image and is served at /.
        ui = client.get("/")
        assert ui.status_code == 200 and "<html" in ui.text.lower(), ui.status_code
        log(f"/ serves the web UI ({len(ui.text)} bytes of HTML)")

        body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        texts: list[str] = []
        events: list[str] = []
        usage = None
        with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, resp.read()
            assert resp.headers["content-type"].startswith("text/event-stream")
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if line[6:] == "[DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                assert chunk["object"] == "text_completion"
                if chunk["choices"]:
                    texts.append(chunk["choices"][0]["text"])
                if chunk.get("usage"):
                    usage = chunk["usage"]
        assert events and events[-1] == "[DONE]"
        assert texts and usage and usage["completion_tokens"] >= 1
        log(f"SSE: {len(events)} events, {len(texts)} text chunks, usage {usage}")

        # The HPA's queue-depth gauge is really exported.
        metrics = client.get("/metrics").text
        assert "streamsd:num_requests_waiting" in metrics
        log("/metrics exports streamsd:num_requests_waiting")


def test_prepulled_image_serves_the_default_model(image, base_image, pip_mounts, tmp_path):
    """PREPULL_DEFAULT=1 bakes the embedded default model into /models, so the image serves it
    with no flags at all. Builds on `image`'s cached layers: only the pull step is new."""
    prepulled = build(IMAGE + "-prepull", base_image, pip_mounts, "PREPULL_DEFAULT=1")
    with container_of(prepulled) as name:
        marker = buildah_run(name, "ls", "/models/models/smollm2-135m-instruct/").stdout.split()
        log(f"baked into /models: {marker}")
        assert "config.json" in marker and any(f.endswith(".safetensors") for f in marker)
        with serving(prepulled, name, ["--device", "cpu", "--drain-timeout", "5"], tmp_path / "server.log") as client:
            assert client.get("/health").json().get("model", "smollm2-135m-instruct") == "smollm2-135m-instruct"
            r = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 24, "temperature": 0})
            assert r.status_code == 200, r.text
            answer = r.json()["choices"][0]["message"]["content"]
            log(f"default model answered {answer!r}, usage {r.json()['usage']}")
            assert answer.strip()
