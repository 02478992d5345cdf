"""A small Hugging Face Hub API server for tests: real HTTP on 127.0.0.1, state in memory.

It answers the routes the real ``huggingface_hub`` client uses to create repositories and
branches, upload folders (model-card YAML check, preupload + NDJSON commit, every file "regular"), read repository info
and trees, and download files (``HEAD``/``GET .../resolve/{revision}/{path}`` with the
``X-Repo-Commit``, ``ETag`` and ``Content-Length`` headers). Errors carry the ``X-Error-Code``
header the client turns into ``RepositoryNotFoundError``, ``RevisionNotFoundError`` and
``EntryNotFoundError``. With a ``token``, writes and reads of private repositories need
``Authorization: Bearer <token>``.

Tests may damage stored files (``corrupt``, ``remove``) to check how readers fail.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

__all__ = ["HubServer"]


@dataclass
class _Repo:
    private: bool
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit sha
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> {path: content}


def _git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubServer:
    """Start with :meth:`start`; ``url`` is the value for ``HF_ENDPOINT``."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.repos: dict[str, _Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path), for assertions
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def start(self) -> HubServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    # -- test helpers ----------------------------------------------------------------------
    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        return repo.commits[repo.branches.get(revision, revision)]

    def _rewrite(self, repo_id: str, path: str, content: bytes | None, branch: str) -> None:
        """Commit a change to one file on a branch, as a push from elsewhere would."""
        files = dict(self.files(repo_id, branch))
        if content is None:
            files.pop(path)
        else:
            files[path] = content
        self._commit(repo_id, branch, files)

    def corrupt(self, repo_id: str, path: str, offset: int = -100, branch: str = "main") -> None:
        data = bytearray(self.files(repo_id, branch)[path])
        data[offset] ^= 0xFF
        self._rewrite(repo_id, path, bytes(data), branch)

    def remove(self, repo_id: str, path: str, branch: str = "main") -> None:
        self._rewrite(repo_id, path, None, branch)

    # -- state -----------------------------------------------------------------------------
    def _commit(self, repo_id: str, branch: str, files: dict[str, bytes]) -> str:
        repo = self.repos[repo_id]
        parent = repo.branches.get(branch, "")
        digest = hashlib.sha1(parent.encode())
        for path in sorted(files):
            digest.update(path.encode() + b"\0" + _git_blob_sha(files[path]).encode())
        sha = digest.hexdigest()
        if sha in repo.commits:  # same tree again: make the commit distinct
            sha = hashlib.sha1((sha + str(len(repo.commits))).encode()).hexdigest()
        repo.commits[sha] = files
        repo.branches[branch] = sha
        return sha

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # keep test output quiet
                pass

            # -- plumbing ------------------------------------------------------------------
            def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if "Content-Length" not in (headers or {}):
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _json(self, status: int, obj: object, headers: dict[str, str] | None = None) -> None:
                self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

            def _error(self, status: int, code: str, message: str) -> None:
                self._json(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _authorized(self) -> bool:
                return server.token is None or self.headers.get("Authorization") == f"Bearer {server.token}"

            def _repo(self, repo_id: str, write: bool = False) -> _Repo | None:
                repo = server.repos.get(repo_id)
                if repo is None or ((write or repo.private) and not self._authorized()):
                    self._error(404 if self._authorized() else 401, "RepoNotFound", f"Repository {repo_id} not found")
                    return None
                return repo

            def _sha(self, repo: _Repo, revision: str) -> str | None:
                sha = repo.branches.get(revision, revision if revision in repo.commits else None)
                if sha is None:
                    self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                return sha

            # -- routes --------------------------------------------------------------------
            def do_HEAD(self) -> None:
                self._dispatch()

            def do_GET(self) -> None:
                self._dispatch()

            def do_POST(self) -> None:
                self._dispatch()

            def _dispatch(self) -> None:
                url = urlsplit(self.path)
                path, query = unquote(url.path), parse_qs(url.query)
                server.requests.append((self.command, path))
                with server._lock:
                    if self.command == "POST" and path == "/api/repos/create":
                        return self._create_repo()
                    if self.command == "POST" and path == "/api/validate-yaml":
                        return self._validate_yaml()
                    if m := re.fullmatch(r"/api/models/(.+)/(preupload|commit|branch)/(.+)", path):
                        if self.command == "POST":
                            return getattr(self, f"_{m.group(2)}")(m.group(1), m.group(3))
                    if m := re.fullmatch(r"/api/models/(.+?)/tree/([^/]+)(?:/(.*))?", path):
                        return self._tree(m.group(1), m.group(2), m.group(3) or "", "recursive" in query)
                    if m := re.fullmatch(r"/api/models/(.+?)(?:/revision/(.+))?", path):
                        return self._info(m.group(1), m.group(2) or "main")
                    if m := re.fullmatch(r"/(.+?)/resolve/([^/]+)/(.+)", path):
                        return self._resolve(m.group(1), m.group(2), m.group(3))
                    self._error(404, "NotFound", f"no route for {self.command} {path}")

            def _create_repo(self) -> None:
                if not self._authorized():
                    return self._error(401, "Unauthorized", "Invalid credentials")
                body = json.loads(self._body())
                repo_id = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
                if repo_id in server.repos:
                    message = "You already created this model repo"
                    return self._json(
                        409, {"error": message, "url": f"{server.url}/{repo_id}"}, {"X-Error-Code": "RepoExists"}
                    )
                server.repos[repo_id] = _Repo(private=body.get("visibility") == "private" or bool(body.get("private")))
                server._commit(repo_id, "main", {".gitattributes": b"*.safetensors filter=lfs diff=lfs\n"})
                self._json(200, {"url": f"{server.url}/{repo_id}", "name": repo_id})

            def _validate_yaml(self) -> None:
                content = json.loads(self._body())["content"]
                try:
                    yaml.safe_load(content.split("---")[1])
                except (IndexError, yaml.YAMLError) as exc:
                    return self._json(400, {"errors": [{"message": f"invalid YAML header: {exc}"}]})
                self._json(200, {"errors": [], "warnings": []})

            def _branch(self, repo_id: str, branch: str) -> None:
                if (repo := self._repo(repo_id, write=True)) is None:
                    return
                body = json.loads(self._body() or b"{}")
                if branch in repo.branches:
                    return self._error(409, "BranchExists", f"Branch {branch} already exists")
                if (start := self._sha(repo, body.get("startingPoint") or "main")) is not None:
                    repo.branches[branch] = start
                    self._json(200, {})

            def _preupload(self, repo_id: str, revision: str) -> None:
                if self._repo(repo_id, write=True) is None:
                    return
                files = json.loads(self._body())["files"]
                self._json(
                    200,
                    {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]},
                )

            def _commit(self, repo_id: str, revision: str) -> None:
                if (repo := self._repo(repo_id, write=True)) is None:
                    return
                if (sha := self._sha(repo, revision)) is None:
                    return
                files = dict(repo.commits[sha])
                for line in self._body().splitlines():
                    op = json.loads(line)
                    if op["key"] == "file":
                        files[op["value"]["path"]] = base64.b64decode(op["value"]["content"])
                    elif op["key"] == "deletedFile":
                        files.pop(op["value"]["path"], None)
                    elif op["key"] == "deletedFolder":
                        prefix = op["value"]["path"].rstrip("/") + "/"
                        files = {p: c for p, c in files.items() if not p.startswith(prefix)}
                    elif op["key"] != "header":
                        return self._error(400, "BadRequest", f"unsupported commit operation {op['key']!r}")
                new = server._commit(repo_id, revision, files)
                self._json(200, {"commitUrl": f"{server.url}/{repo_id}/commit/{new}", "commitOid": new})

            def _info(self, repo_id: str, revision: str) -> None:
                if (repo := self._repo(repo_id)) is None or (sha := self._sha(repo, revision)) is None:
                    return
                files = repo.commits[sha]
                self._json(
                    200,
                    {
                        "id": repo_id,
                        "modelId": repo_id,
                        "sha": sha,
                        "private": repo.private,
                        "siblings": [{"rfilename": p} for p in sorted(files)],
                    },
                )

            def _tree(self, repo_id: str, revision: str, under: str, recursive: bool) -> None:
                if (repo := self._repo(repo_id)) is None or (sha := self._sha(repo, revision)) is None:
                    return
                prefix = under.rstrip("/") + "/" if under else ""
                items, folders = [], set()
                for p, content in sorted(repo.commits[sha].items()):
                    if not p.startswith(prefix):
                        continue
                    rest = p[len(prefix) :].split("/")
                    depth = len(rest) if recursive else 1
                    for i in range(1, min(len(rest), depth + 1)):
                        folders.add(prefix + "/".join(rest[:i]))
                    if recursive or len(rest) == 1:
                        items.append({"type": "file", "path": p, "size": len(content), "oid": _git_blob_sha(content)})
                items += [
                    {"type": "directory", "path": f, "oid": hashlib.sha1(f.encode()).hexdigest()} for f in folders
                ]
                self._json(200, items)

            def _resolve(self, repo_id: str, revision: str, filename: str) -> None:
                if (repo := self._repo(repo_id)) is None or (sha := self._sha(repo, revision)) is None:
                    return
                content = repo.commits[sha].get(filename)
                if content is None:
                    return self._error(404, "EntryNotFound", f"{filename} does not exist at {revision}")
                headers = {
                    "X-Repo-Commit": sha,
                    "ETag": f'"{_git_blob_sha(content)}"',
                    "Content-Length": str(len(content)),
                    "Content-Type": "application/octet-stream",
                }
                self._send(200, content, headers)

        return Handler
