"""A loopback Hugging Face Hub emulator for tests: 127.0.0.1, a random port, one thread running http.server.

It speaks the part of the Hub protocol that huggingface_hub's real download path uses:
HEAD/GET `/{org}/{name}/resolve/{revision}/{path}` with `ETag`, `X-Repo-Commit`, `Content-Length`,
`Accept-Ranges` and Range requests (206 + `Content-Range`), and 404s carrying `X-Error-Code` (`RepoNotFound`,
`RevisionNotFound`, `EntryNotFound`) so the client raises its own typed errors.

Large-file storage like the Hub's: `.safetensors` and `.gguf` files (`lfs_suffixes`) answer the resolve URL with a 302 to a
"CDN" on another host name (`localhost` instead of `127.0.0.1`) carrying `X-Linked-Size` / `X-Linked-Etag`, so the
client takes the metadata from the redirect and fetches the bytes from the CDN URL, as it does on the real Hub.

Fault injection: `tamper[(repo, path)] = bytes` serves other bytes of the same size; `drop[(repo, path)] = n`
sends the full Content-Length, then only n bytes, then closes the connection (once, on the first GET
without a Range header); `pad[(repo, path)] = bytes` appends bytes to every GET body while HEAD and the
redirect still report the true size (a server that sends more than it announced); `short[(repo, path)] = n`
answers a GET with only the first n bytes of the body and a Content-Length that says so (a server whose copy ends
early); `flaky[(repo, path)] = (n, k)` cuts each of the next k GETs after n bytes, Range or not (a link that drops
every n bytes); `delay = s` sleeps s seconds per 64 KiB sent (a slow link, so that runs overlap);
`ignore_range = True` answers every GET with the whole file (200), as some CDNs do.

Branches, tags and the model API, as `strata-setup models add` meets them: `publish(repo, files, ref="main")` makes
a new commit (a 40-hex id) and points the ref at it; every URL then accepts the ref name or the commit, and answers
with the commit in `X-Repo-Commit`. `GET /api/models/{repo}[/revision/{rev}]` returns the repository's metadata as
the Hub does (`sha` = the resolved commit; with `?blobs=true` each sibling's `size`, git `blobId` and, for LFS
files, `lfs: {sha256, size, pointerSize}`). Access: `private[repo] = token` answers 401 (`RepoNotFound`, as the Hub
does for a private repo) to any request without `Authorization: Bearer <token>`; `gated[repo] = token` answers the
file URLs with 403 (`GatedRepo`) but serves the metadata, as the Hub does for a gated repo.
"""

from __future__ import annotations

import hashlib
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_CDN = re.compile(r"^/cdn/(?P<org>[^/]+)/(?P<name>[^/]+)/(?P<rev>[^/]+)/(?P<path>.+)$")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>.+))?$")


def git_blob_id(data: bytes) -> str:
    """The git object id of a file's bytes (what the Hub reports as `blobId`)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, dict[str, bytes]]] = {}   # repo -> revision -> path -> bytes
        self.tamper: dict[tuple[str, str], bytes] = {}
        self.drop: dict[tuple[str, str], int] = {}
        self.pad: dict[tuple[str, str], bytes] = {}               # extra bytes after a GET body (HEAD: true size)
        self.short: dict[tuple[str, str], int] = {}
        self.flaky: dict[tuple[str, str], tuple[int, int]] = {}
        self.delay = 0.0
        self.ignore_range = False
        self.log: list[tuple[str, str, str | None]] = []          # (method, path, Range header), bytes served
        self.redirects: list[str] = []                             # resolve paths answered with a 302
        self.lfs_suffixes: tuple[str, ...] = (".safetensors", ".gguf")
        self.auth: list[tuple[str, str | None]] = []               # (path, Authorization header) of every request
        self.refs: dict[str, dict[str, str]] = {}                  # repo -> branch or tag -> commit
        self.private: dict[str, str] = {}                          # repo -> the token that may read it
        self.gated: dict[str, str] = {}                            # repo -> the token that accepted its terms
        self.api_calls: list[str] = []                             # paths of /api/models requests
        self._commits = 0
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._serve(self, head=True)

            def do_GET(self) -> None:
                hub._serve(self, head=False)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:  # a client that went away (killed): quiet
                import sys

                if not isinstance(sys.exc_info()[1], ConnectionError):
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.cdn_url = f"http://localhost:{self.server.server_address[1]}/cdn"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, repo: str, revision: str, files: dict[str, bytes]) -> None:
        self.repos.setdefault(repo, {})[revision] = dict(files)

    def publish(self, repo: str, files: dict[str, bytes], ref: str = "main") -> str:
        """A new commit holding `files`, with `ref` (a branch or tag) pointing at it; returns the commit id."""
        self._commits += 1
        h = hashlib.sha1(f"{repo} {ref} {self._commits}".encode())
        for path in sorted(files):
            h.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
        commit = h.hexdigest()
        self.add(repo, commit, files)
        self.refs.setdefault(repo, {})[ref] = commit
        return commit

    def commit_of(self, repo: str, rev: str) -> str | None:
        if rev in self.repos.get(repo, {}):
            return rev
        return self.refs.get(repo, {}).get(rev)

    def start(self) -> FakeHub:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def gets(self, path: str) -> list[str | None]:
        """Range headers of the GETs made for a file path (None = whole file)."""
        return [r for m, p, r in self.log if m == "GET" and p.endswith("/" + path)]

    # -- serving ---------------------------------------------------------------------------------------------------
    def _error(self, h: BaseHTTPRequestHandler, code: int, err: str, msg: str) -> None:
        body = msg.encode()
        h.send_response(code)
        h.send_header("X-Error-Code", err)
        h.send_header("X-Error-Message", msg)
        h.send_header("Content-Type", "text/plain")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    def _allowed(self, h: BaseHTTPRequestHandler, repo: str, table: dict[str, str]) -> bool:
        return repo not in table or h.headers.get("Authorization") == f"Bearer {table[repo]}"

    def _api(self, h: BaseHTTPRequestHandler, repo: str, rev: str | None, query: str) -> None:
        import json

        with self._lock:
            self.api_calls.append(h.path)
        if not self._allowed(h, repo, self.private):
            return self._error(h, 401, "RepoNotFound", "Invalid username or password.")
        if repo not in self.repos:
            return self._error(h, 404, "RepoNotFound", "Repository not found")
        commit = self.commit_of(repo, rev or "main")
        if commit is None:
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        siblings = []
        for rel, data in sorted(self.repos[repo][commit].items()):
            sib = {"rfilename": rel}
            if "blobs=true" in query:
                sib.update(size=len(data), blobId=git_blob_id(data))
                if rel.endswith(self.lfs_suffixes):
                    sib["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                                  "pointerSize": 134}
            siblings.append(sib)
        body = json.dumps({"_id": "0" * 24, "id": repo, "modelId": repo, "sha": commit,
                           "private": repo in self.private, "gated": "manual" if repo in self.gated else False,
                           "disabled": False, "tags": [], "siblings": siblings,
                           "lastModified": "2025-01-01T00:00:00.000Z"}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    def _serve(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path, _, query = h.path.partition("?")
        path = unquote(path)
        rng = h.headers.get("Range")
        cdn = _CDN.match(path)
        m = _RESOLVE.match(path)
        with self._lock:
            self.auth.append((path, h.headers.get("Authorization")))
        if (api := _API.match(path)) is not None:
            return self._api(h, api["repo"], api["rev"], query)
        if cdn:
            repo, rev, rel = f"{cdn['org']}/{cdn['name']}", cdn["rev"], cdn["path"]
        elif m:
            repo, rev, rel = m["repo"], m["rev"], m["path"]
        else:
            return self._error(h, 404, "RepoNotFound", "not found")
        if m and not self._allowed(h, repo, self.private):
            return self._error(h, 401, "RepoNotFound", "Invalid username or password.")
        if repo not in self.repos:
            return self._error(h, 404, "RepoNotFound", "Repository not found")
        if m and not self._allowed(h, repo, self.gated):
            return self._error(h, 403, "GatedRepo", f"Access to model {repo} is restricted.")
        commit = self.commit_of(repo, rev)
        if commit is None:
            return self._error(h, 404, "RevisionNotFound", "Invalid rev id: " + rev)
        rev = commit
        files = self.repos[repo][rev]
        if rel not in files:
            return self._error(h, 404, "EntryNotFound", f"{rel} does not exist at {rev}")
        data = self.tamper.get((repo, rel), files[rel])
        etag = hashlib.sha256(files[rel]).hexdigest()
        total = len(data)
        if m and rel.endswith(self.lfs_suffixes):  # LFS: metadata on the redirect, bytes from the CDN
            with self._lock:
                self.redirects.append(path)
            h.send_response(302)
            h.send_header("Location", f"{self.cdn_url}/{repo}/{rev}/{rel}")
            h.send_header("X-Linked-Size", str(total))
            h.send_header("X-Linked-Etag", f'"{etag}"')
            h.send_header("ETag", '"pointer-etag"')
            h.send_header("X-Repo-Commit", rev)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        with self._lock:
            self.log.append((h.command, path, rng))
        start, end, status = 0, total - 1, 200
        if rng and not head and not self.ignore_range:
            r = _RANGE.match(rng.strip())
            if r is None:
                return self._error(h, 416, "RangeNotSatisfiable", "bad range")
            a, b = r.groups()
            if a == "":
                start, end = max(total - int(b), 0), total - 1
            else:
                start, end = int(a), min(int(b) if b else total - 1, total - 1)
            if start >= total:
                h.send_response(416)
                h.send_header("Content-Range", f"bytes */{total}")
                h.send_header("Content-Length", "0")
                h.end_headers()
                return
            status = 206
        body = data[start:end + 1] + (b"" if head else self.pad.get((repo, rel), b""))
        if not head and (repo, rel) in self.short:
            body = body[:max(self.short[(repo, rel)] - start, 0)]
        h.send_response(status)
        h.send_header("ETag", f'"{etag}"')
        h.send_header("X-Repo-Commit", rev)
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(body)))
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{end}/{total}")
        h.end_headers()
        if head:
            return
        cut = self.drop.pop((repo, rel), None) if rng is None else None  # only a whole-file GET is cut
        with self._lock:
            if (repo, rel) in self.flaky:
                n, k = self.flaky[(repo, rel)]
                cut = n
                if k <= 1:
                    del self.flaky[(repo, rel)]
                else:
                    self.flaky[(repo, rel)] = (n, k - 1)
        if cut is not None and cut < len(body):
            h.wfile.write(body[:cut])
            h.wfile.flush()
            h.close_connection = True
            import socket

            try:
                h.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if self.delay:
            import time

            for i in range(0, len(body), 1 << 16):
                h.wfile.write(body[i:i + (1 << 16)])
                h.wfile.flush()
                time.sleep(self.delay)
            return
        h.wfile.write(body)
