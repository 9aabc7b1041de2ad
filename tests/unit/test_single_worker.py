"""The continuous-batching worker lock (``handler.single_worker``) and the worker's id."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from handler import single_worker
from handler.sd_handler import worker_id
from server.paths import ROOT

CLAIM_IN_ANOTHER_PROCESS = (
    "import sys\n"
    "from handler import single_worker\n"
    "try:\n"
    "    single_worker.claim(sys.argv[1], 'stable-diffusion')\n"
    "except single_worker.SecondWorkerError as error:\n"
    "    print(error)\n"
    "    sys.exit(3)\n"
)


def claim_elsewhere(model_dir) -> subprocess.CompletedProcess:
    """A claim from another process, as a second TorchServe worker makes it."""
    return subprocess.run(
        [sys.executable, "-c", CLAIM_IN_ANOTHER_PROCESS, str(model_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_second_worker_is_refused_naming_the_mode_and_both_ways_out_until_the_first_is_gone(tmp_path):
    held = single_worker.claim(tmp_path, "stable-diffusion")
    refused = claim_elsewhere(tmp_path)
    assert refused.returncode == 3, refused.stderr
    for words in ("continuous batching", "min_worker=1&max_worker=1", "continuousBatching: false", "make mar"):
        assert words in refused.stdout
    with pytest.raises(single_worker.SecondWorkerError):
        single_worker.claim(tmp_path, "stable-diffusion")  # also within one process: each claim opens the file anew
    os.close(held)  # what the kernel does when the first worker's process dies
    assert claim_elsewhere(tmp_path).returncode == 0


def test_a_no_archive_model_keeps_its_lock_beside_the_link_not_in_the_model_directory(tmp_path):
    model_store = tmp_path / "model_store" / "stable-diffusion"
    model_store.mkdir(parents=True)
    registration = tmp_path / "models" / "0123abcd"
    registration.mkdir(parents=True)
    (registration / "stable-diffusion").symlink_to(model_store)
    descriptor = single_worker.claim(registration / "stable-diffusion", "stable-diffusion")
    assert (registration / single_worker.LOCK_FILE).is_file() and list(model_store.iterdir()) == []
    os.close(descriptor)


def test_without_a_place_for_the_lock_the_worker_serves_and_says_so(tmp_path, caplog):
    assert single_worker.claim(tmp_path / "missing", "stable-diffusion") is None
    assert "a second worker would not be refused" in caplog.text


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["model_service_worker.py", "--sock-type", "unix", "--sock-name", "/tmp/.ts.sock.9001"], "9001"),
        (["model_service_worker.py", "--sock-type", "tcp", "--port", "9002", "--host", "127.0.0.1"], "9002"),
        (["pytest"], None),  # no socket: this process's id
    ],
    ids=["unix", "tcp", "no-socket"],
)
def test_the_worker_id_is_the_port_the_describe_api_names_it_by(argv, expected):
    assert worker_id(argv) == (expected or str(os.getpid()))
