"""The JupyterLab server that launchers/lab starts: it serves, and the nbgrader and widget extensions are on."""

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, token: str) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, response.read().decode()


@pytest.fixture(scope="module")
def server():
    port, token = free_port(), uuid.uuid4().hex
    proc = subprocess.Popen(["bash", str(REPO / "launchers" / "lab"), "--no-browser", f"--port={port}",
                             "--ip=127.0.0.1", f"--IdentityProvider.token={token}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    try:
        while True:
            try:
                if get(f"{base}/api/status", token)[0] == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"JupyterLab did not start:\n{proc.stdout.read()[-3000:]}")
            time.sleep(0.5)
        yield base, token
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_lab_serves_the_labs_folder(server):
    base, token = server
    status, body = get(f"{base}/api/contents", token)
    assert status == 200
    names = {item["name"] for item in json.loads(body)["content"]}
    assert "01_gradient_accumulation" in names, f"JupyterLab should open on labs/, it shows {sorted(names)}"


def test_nbgrader_and_widget_extensions_are_enabled(server):
    base, token = server
    status, page = get(f"{base}/lab", token)
    assert status == 200
    config = json.loads(re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>', page, re.S).group(1))
    extensions = {ext["name"] for ext in config.get("federated_extensions", [])}
    disabled = set(config.get("disabledExtensions", []))
    for name in ("@jupyter/nbgrader", "@jupyter-widgets/jupyterlab-manager"):
        assert name in extensions, f"lab extension {name} missing; found {sorted(extensions)}"
        assert name not in disabled
    # nbgrader's server side (the Validate button and the formgrader) answers too.
    status, _ = get(f"{base}/formgrader", token)
    assert status == 200


def test_no_news_prompt_and_no_update_check(server):
    # The course's settings overrides (launchers/lab): a student is not asked "Would you like to get notified about
    # official Jupyter news?" on the first start, and JupyterLab does not look for updates.
    base, token = server
    status, body = get(f"{base}/lab/api/settings/@jupyterlab/apputils-extension:notification", token)
    assert status == 200
    defaults = {name: spec.get("default") for name, spec in json.loads(body)["schema"]["properties"].items()}
    assert defaults.get("fetchNews") == "false" and defaults.get("checkForUpdates") is False, defaults
